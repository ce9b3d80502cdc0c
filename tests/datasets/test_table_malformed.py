"""Bad values in tables, random-data parameters and multi-hot ids raise; nothing propagates."""

import numpy as np
import pytest

from jaxrec.datasets import MultiHot, RandomRecDataset, Table, TableDataset


def table(n=6, dense_value=None, label_value=None, row=4):
    dense = np.zeros((n, 2), np.float32)
    labels = np.zeros(n, np.float32)
    if dense_value is not None:
        dense[row, 1] = dense_value
    if label_value is not None:
        labels[row] = label_value
    return Table(dense, [np.arange(n) % 3], labels)


def dataset(*tables):
    return TableDataset(list(tables), keys=["a"], num_embeddings_per_feature=[3])


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(dense_value=np.nan), r"table 1 row 4: non-finite dense value nan"),
        (dict(dense_value=-np.inf), r"table 1 row 4: non-finite dense value -inf"),
        (dict(label_value=np.nan), r"table 1 row 4: non-finite label nan"),
    ],
)
def test_non_finite_values_name_table_and_row(kw, message):
    data = dataset(table(), table(**kw))
    with pytest.raises(ValueError, match=message):
        list(data.batches(4, shuffle=True, seed=1))


def test_dataset_with_no_rows_raises():
    with pytest.raises(ValueError, match="no rows"):
        dataset(table(n=0))


@pytest.mark.parametrize("num_samples", [0, -3])
def test_random_dataset_needs_samples(num_samples):
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        RandomRecDataset(["a"], num_samples, hash_size=5)


@pytest.mark.parametrize(
    "name", ["alpha", "bias_scale", "dense_scale", "latent_scale", "intercept"]
)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_random_dataset_rejects_non_finite_parameters(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be finite"):
        RandomRecDataset(["a", "b"], 10, hash_size=5, **{name: value})


@pytest.mark.parametrize("method", ["table", "hash"])
@pytest.mark.parametrize("bad", [-1, 7])
def test_multi_hot_ids_out_of_range(method, bad):
    mh = MultiHot([3], [7], method=method)
    with pytest.raises(ValueError, match=rf"table 0: ids must lie in \[0, 7\), got {bad}"):
        mh.expand(0, np.array([0, bad, 2]))
