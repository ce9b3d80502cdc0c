"""``mean_scale``: the MEAN factors every pooled path (lookup, quantized lookup, backward) uses."""

import numpy as np
import pytest

from jaxrec import KeyedJaggedTensor, PoolingType
from jaxrec.xla.slots import FeatureSlot, mean_scale

MEAN, SUM = PoolingType.MEAN, PoolingType.SUM


def _slot(key, pooling):
    return FeatureSlot(key=key, row_offset=0, num_embeddings=10, pooling=pooling)


def _reference(lengths, keys, slots, b):
    """Plain Python: slot s, bag i -> 1 / max(length, 1) for MEAN, 1 for SUM."""
    per_key = {k: lengths[i * b : (i + 1) * b] for i, k in enumerate(keys)}
    return np.asarray(
        [
            [1.0 / max(per_key[sl.key][i], 1) if sl.pooling is MEAN else 1.0 for sl in slots]
            for i in range(b)
        ],
        np.float32,
    )


@pytest.mark.parametrize(
    "poolings", [(MEAN, SUM, MEAN), (SUM, MEAN, SUM), (MEAN, MEAN, MEAN)], ids=str
)
def test_mean_scale_matches_a_plain_reference(poolings):
    keys, b = ["a", "b"], 4
    lengths = [3, 0, 1, 2, 5, 1, 0, 4]  # empty bags divide by 1
    kjt = KeyedJaggedTensor(keys, np.arange(16), lengths=lengths, capacities=[6, 10])
    slots = [_slot(k, p) for k, p in zip(["b", "a", "b"], poolings, strict=True)]  # a key twice
    got = mean_scale(kjt, slots)
    assert got.shape == (b, len(slots))
    np.testing.assert_array_equal(np.asarray(got), _reference(lengths, keys, slots, b))


def test_invalid_bags_divide_by_one_and_sum_only_is_none():
    lengths = np.asarray([2, -3, 1], np.int32)  # a negative length: an invalid bag
    kjt = KeyedJaggedTensor(["a"], np.arange(4), lengths=lengths, capacities=[4], validate=False)
    got = np.asarray(mean_scale(kjt, [_slot("a", MEAN)]))
    np.testing.assert_array_equal(got[:, 0], [0.5, 1.0, 1.0])
    assert mean_scale(kjt, [_slot("a", SUM)]) is None
