"""KeyedJaggedTensor with a variable batch per key (VBE): layout, builders, errors."""

import jax
import numpy as np
import pytest

from jaxrec.sparse import KeyedJaggedTensor, dedup_features, expand_vbe, pad_strides

KEYS = ["user", "item"]


def plain_batch():
    # 4 samples, users u0 u1 u0 u1: "user" repeats per user, "item" does not.
    return KeyedJaggedTensor.from_lengths_sync(
        KEYS, [7, 8, 9, 7, 8, 9, 3, 4, 5, 6], [2, 1, 2, 1, 1, 1, 2, 0], on_host=True
    )


def test_dedup_layout_matches_torchrec_conventions():
    vbe = dedup_features(plain_batch(), {"user": [10, 11, 10, 11]})
    assert vbe.variable_stride_per_key() and vbe.stride() == 4
    assert vbe.stride_per_key() == [2, 4] and vbe.bag_offsets() == (0, 2, 6)
    keys, inv = vbe.inverse_indices()
    assert keys == KEYS and inv.tolist() == [[0, 1, 0, 1], [0, 1, 2, 3]]
    assert np.asarray(vbe.lengths()).tolist() == [2, 1, 1, 1, 2, 0]
    assert np.asarray(vbe.length_per_key()).tolist() == [3, 4]
    # segment ids: key k's bag b is bag_offsets[k] + b; padding gets sum(B_k)
    seg = np.asarray(vbe.segment_ids())
    cap0 = vbe.capacity_per_key()[0]
    assert seg[:3].tolist() == [0, 0, 1] and (seg[3:cap0] == 6).all()
    assert seg[cap0 : cap0 + 4].tolist() == [2, 3, 4, 4]
    assert np.asarray(vbe["user"].lengths()).tolist() == [2, 1]


def test_expand_is_the_inverse_of_dedup_and_survives_jit():
    plain = plain_batch()
    vbe = dedup_features(plain, {"user": [10, 11, 10, 11]}, stride_per_key={"user": 3})
    assert vbe.stride_per_key() == [3, 4]  # padded with an empty bag no sample reads
    back = expand_vbe(vbe, capacities=plain.capacity_per_key())
    np.testing.assert_array_equal(back.lengths(), plain.lengths())
    np.testing.assert_array_equal(back.values(), plain.values())
    traced = jax.jit(lambda k: k)(vbe)  # a pytree: strides static, inverse a leaf
    assert traced.stride_per_key() == [3, 4]
    np.testing.assert_array_equal(traced.segment_ids(), vbe.segment_ids())


def test_permute_concat_and_pad_keep_each_keys_bags():
    vbe = dedup_features(plain_batch(), {"user": [10, 11, 10, 11]})
    swapped = vbe.permute([1, 0])
    assert swapped.stride_per_key() == [4, 2]
    np.testing.assert_array_equal(swapped.inverse_indices()[1][1], [0, 1, 0, 1])
    extra = KeyedJaggedTensor.from_lengths_sync(["x"], [1], [1, 0, 0, 0])
    both = KeyedJaggedTensor.concat([vbe, extra])
    assert both.stride_per_key() == [2, 4, 4]
    np.testing.assert_array_equal(both.inverse_indices()[1][2], [0, 1, 2, 3])
    padded = pad_strides(vbe, [5, 4])
    assert np.asarray(padded.lengths()).tolist() == [2, 1, 0, 0, 0, 1, 1, 2, 0]
    np.testing.assert_array_equal(padded["item"].lengths(), vbe["item"].lengths())


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="needs both stride_per_key"):
        KeyedJaggedTensor(["a"], [1], lengths=[1], stride_per_key=[1])
    with pytest.raises(ValueError, match=r"inverse_indices must be \[F, B\]"):
        KeyedJaggedTensor(["a"], [1], lengths=[1], stride_per_key=[1], inverse_indices=[0, 0])
    with pytest.raises(ValueError, match="must lie in"):
        KeyedJaggedTensor(["a"], [1], lengths=[1], stride_per_key=[1], inverse_indices=[[0, 1]])
    with pytest.raises(ValueError, match="sums to"):
        KeyedJaggedTensor(["a"], [1], lengths=[1, 0], stride_per_key=[1], inverse_indices=[[0]])
    with pytest.raises(ValueError, match="share group"):
        dedup_features(plain_batch(), {"user": [10, 10, 10, 11]})
    with pytest.raises(ValueError, match="below the batch's 2 distinct groups"):
        dedup_features(plain_batch(), {"user": [10, 11, 10, 11]}, stride_per_key={"user": 1})
    vbe = dedup_features(plain_batch(), {"user": [10, 11, 10, 11]})
    with pytest.raises(NotImplementedError, match="expand_vbe"):
        vbe.require_uniform_stride("a test consumer")
    with pytest.raises(ValueError, match="no inverse_indices"):
        plain_batch().inverse_indices()
