"""A batch of zero samples (B = 0) through the embedding collections.

The pooled reshape used to infer a dimension from a zero-sized array
(``ZeroDivisionError``); now every path returns empty outputs.
"""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxrec as jr
from jaxrec import cpu

IMPLS = ["xla", pytest.param("cpu", marks=pytest.mark.skipif(not cpu.available(), reason="no C++"))]
KEYS = ["f0", "f1", "f2"]


def empty_batch(capacity, weighted=False):
    if capacity is None:  # the host builder's packed layout
        w = [] if weighted else None
        return jr.KeyedJaggedTensor.from_lengths_sync(KEYS, [], [], weights=w, stride=0)
    w = np.zeros(3 * capacity, np.float32) if weighted else None
    return jr.KeyedJaggedTensor(
        KEYS,
        np.zeros(3 * capacity, np.int32),
        w,
        lengths=np.zeros(0, np.int32),
        stride=0,
        capacities=[capacity] * 3,
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("capacity", [None, 0, 8])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_embedding_bag_collection(impl, capacity, jit, weighted):
    tables = [  # two groups (d4, d3); t0 is MEAN and read by two features
        jr.EmbeddingBagConfig(
            name="t0",
            embedding_dim=4,
            num_embeddings=6,
            feature_names=["f0", "f2"],
            pooling=jr.PoolingType.MEAN,
        ),
        jr.EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=6, feature_names=["f1"]),
    ]
    ebc = jr.EmbeddingBagCollection(
        tables, weighted, rngs=nnx.Rngs(0), implementation=impl, bounds_check_mode="FATAL"
    )
    kjt = empty_batch(capacity, weighted)
    call = jax.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    out = call(ebc, kjt)
    assert out.keys() == ["f0", "f2", "f1"]
    assert out.values().shape == (0, 11) and out.values().dtype == np.float32
    assert {k: v.shape for k, v in out.to_dict().items()} == {
        "f0": (0, 4),
        "f2": (0, 4),
        "f1": (0, 3),
    }
    one_group = jr.EmbeddingBagCollection(tables[:1], rngs=nnx.Rngs(0), implementation=impl)
    assert call(one_group, kjt).values().shape == (0, 8)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("capacity", [None, 0, 8])
@pytest.mark.parametrize("jit", [False, True])
def test_embedding_collection(impl, capacity, jit):
    tables = [
        jr.EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=6, feature_names=["f0"]),
        jr.EmbeddingConfig(name="t1", embedding_dim=3, num_embeddings=6, feature_names=["f1"]),
    ]
    ec = jr.EmbeddingCollection(tables, need_indices=True, rngs=nnx.Rngs(0), implementation=impl)
    kjt = empty_batch(capacity)
    call = jax.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    out = call(ec, kjt)
    assert sorted(out) == ["f0", "f1"]
    for name, dim in (("f0", 4), ("f1", 3)):
        jt = out[name]
        cap = kjt.capacity_per_key()[KEYS.index(name)]
        assert jt.values().shape == (cap, dim) and jt.lengths().shape == (0,)
        np.testing.assert_array_equal(jt.values(), np.zeros((cap, dim)))
        assert jt.to_dense() == []
