"""Pooled and sequence lookups against the numpy reference."""

import logging

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from numpy_reference import packed, pooled, random_bags

from jaxrec import KeyedJaggedTensor, PoolingType
from jaxrec.ops import (
    BoundsCheckMode,
    FeatureSlot,
    grouped_pooled_lookup,
    grouped_sequence_lookup,
    pooled_lookup,
    sequence_lookup,
)

TOL = {jnp.float32: 1e-5, jnp.float16: 2e-3, jnp.bfloat16: 2e-2}


def test_tutorial_embedding_bag_mean():
    # TorchRec intro: nn.EmbeddingBag (mean) over ids [1, 3] of the 10 x 4 table.
    weights = np.array(
        [
            [0.8823, 0.9150, 0.3829, 0.9593],
            [0.3904, 0.6009, 0.2566, 0.7936],
            [0.9408, 0.1332, 0.9346, 0.5936],
            [0.8694, 0.5677, 0.7411, 0.4294],
            [0.8854, 0.5739, 0.2666, 0.6274],
            [0.2696, 0.4414, 0.2969, 0.8317],
            [0.1053, 0.2695, 0.3588, 0.1994],
            [0.5472, 0.0062, 0.9516, 0.0753],
            [0.8860, 0.5832, 0.3376, 0.8090],
            [0.5779, 0.9040, 0.5547, 0.3423],
        ],
        np.float32,
    )
    ids, lengths = jnp.array([1, 3]), jnp.array([2])
    out = pooled_lookup(jnp.asarray(weights), ids, lengths, pooling=PoolingType.MEAN)
    np.testing.assert_allclose(out, [[0.6299, 0.5843, 0.4988, 0.6115]], atol=1e-4)
    rows = sequence_lookup(jnp.asarray(weights), ids, lengths)
    np.testing.assert_allclose(rows, weights[[1, 3]])


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 6),
    max_len=st.integers(0, 5),
    pooling=st.sampled_from(["SUM", "MEAN"]),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pooled_lookup_property(batch, max_len, pooling, weighted, seed):
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(20, 3)).astype(np.float32)
    bags = random_bags(rng, batch, max_len, 20)
    w = [rng.uniform(0.5, 2, len(b)).tolist() for b in bags] if weighted else None
    values, lengths = packed([bags])
    cap = len(values) + 3  # padding that must not contribute
    vals = np.concatenate([values, rng.integers(0, 20, 3)]).astype(np.int32)
    flat_w = None
    if weighted:
        flat_w = jnp.asarray(np.concatenate([np.concatenate([[], *w]), [9.0] * 3]), jnp.float32)
    out = pooled_lookup(
        jnp.asarray(table),
        jnp.asarray(vals),
        jnp.asarray(lengths, jnp.int32),
        flat_w,
        pooling=PoolingType(pooling),
    )
    assert vals.shape[0] == cap
    np.testing.assert_allclose(out, pooled(table, bags, pooling, w), rtol=1e-5, atol=1e-5)


def _grouped_case(rng, dims_dtype=jnp.float32, batch=5, weighted=False):
    """Three features over two stacked tables; f_shared is read by both."""
    t1, t2 = rng.normal(size=(30, 4)), rng.normal(size=(40, 4))
    stacked = jnp.asarray(np.concatenate([t1, t2]), dims_dtype)
    keys = ["f_a", "f_shared", "f_b"]
    nums = {"f_a": 30, "f_shared": 30, "f_b": 40}
    bags = [random_bags(rng, batch, 4, nums[k]) for k in keys]
    bags[2][0] = [7, 7, 7]  # duplicate ids in one bag
    values, lengths = packed(bags)
    w = rng.uniform(0.1, 1, len(values)) if weighted else None
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=w)
    slots = [
        FeatureSlot(key="f_a", row_offset=0, num_embeddings=30),
        FeatureSlot(key="f_shared", row_offset=0, num_embeddings=30, pooling=PoolingType.MEAN),
        FeatureSlot(key="f_b", row_offset=30, num_embeddings=40),
        FeatureSlot(key="f_shared", row_offset=30, num_embeddings=40),
    ]
    tables = [t1, t1, t2, t2]
    key_of = [0, 1, 2, 1]
    per_bag_w = None
    if weighted:
        off = np.concatenate([[0], np.cumsum(lengths)])
        per_bag_w = [
            [w[off[k * batch + b] : off[k * batch + b + 1]] for b in range(batch)] for k in range(3)
        ]
    return stacked, kjt, slots, tables, key_of, bags, per_bag_w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
def test_grouped_pooled_lookup(dtype, weighted):
    rng = np.random.default_rng(1)
    stacked, kjt, slots, tables, key_of, bags, w = _grouped_case(rng, dtype, weighted=weighted)
    out = jax.jit(lambda t, k: grouped_pooled_lookup(t, k, slots, is_weighted=weighted))(
        stacked, kjt
    )
    assert out.shape == (5, 4, 4) and out.dtype == jnp.float32
    for s, slot in enumerate(slots):
        ref_table = np.asarray(jnp.asarray(tables[s], dtype).astype(jnp.float32))
        ref = pooled(
            ref_table,
            bags[key_of[s]],
            PoolingType(slot.pooling).value,
            None if w is None else w[key_of[s]],
        )
        np.testing.assert_allclose(out[:, s], ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_grouped_sequence_lookup_zero_padding():
    rng = np.random.default_rng(2)
    stacked, kjt, slots, tables, key_of, bags, _ = _grouped_case(rng)
    outs = grouped_sequence_lookup(stacked, kjt, slots)
    for s, out in enumerate(outs):
        ids = [i for b in bags[key_of[s]] for i in b]
        assert out.shape == (kjt.capacity_per_key()[key_of[s]], 4)
        np.testing.assert_allclose(out[: len(ids)], tables[s][ids], rtol=1e-6)
        assert not np.any(np.asarray(out[len(ids) :]))


def test_missing_key_and_weights_errors():
    rng = np.random.default_rng(3)
    stacked, kjt, slots, *_ = _grouped_case(rng)
    with pytest.raises(ValueError, match="lack keys \\['nope'\\]"):
        grouped_pooled_lookup(
            stacked, kjt, [FeatureSlot(key="nope", row_offset=0, num_embeddings=3)]
        )
    with pytest.raises(ValueError, match="carry no weights"):
        grouped_pooled_lookup(stacked, kjt, slots, is_weighted=True)
    with pytest.raises(ValueError, match="implementation must be"):
        grouped_pooled_lookup(stacked, kjt, slots, implementation="cuda")
    # "pallas" runs the kernel (interpreted off GPU): same result as XLA.
    np.testing.assert_allclose(
        grouped_pooled_lookup(stacked, kjt, slots, implementation="pallas"),
        grouped_pooled_lookup(stacked, kjt, slots, implementation="xla"),
        rtol=1e-6,
    )


# ---- bounds checking ----


def _bad_batch():
    table = jnp.arange(12.0).reshape(6, 2)
    return table, jnp.array([1, 6, -1, 2]), jnp.array([3, 1])


def test_bounds_warning_drops_and_logs(caplog):
    table, ids, lengths = _bad_batch()
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        out = jax.jit(pooled_lookup)(table, ids, lengths).block_until_ready()
    np.testing.assert_allclose(out, [[2.0, 3.0], [4.0, 5.0]])  # ids 6 and -1 dropped
    assert "2 ids out of range in pooled_lookup" in caplog.text


def test_bounds_ignore_is_silent(caplog):
    table, ids, lengths = _bad_batch()
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        out = pooled_lookup(table, ids, lengths, bounds_check_mode=BoundsCheckMode.IGNORE)
    np.testing.assert_allclose(out, [[2.0, 3.0], [4.0, 5.0]])
    assert caplog.text == ""


def test_bounds_fatal_raises():
    table, ids, lengths = _bad_batch()
    f = jax.jit(lambda t, i, n: pooled_lookup(t, i, n, bounds_check_mode=BoundsCheckMode.FATAL))
    with pytest.raises(Exception, match="ids out of range in pooled_lookup"):
        f(table, ids, lengths).block_until_ready()
    ok = f(table, jnp.array([1, 2, 3, 0]), lengths)
    np.testing.assert_allclose(ok, [[12.0, 15.0], [0.0, 1.0]])


def test_bounds_checked_per_table_in_stacked_buffer(caplog):
    # id 35 is valid for the 40-row table but not for the 30-row one it is sent to.
    rng = np.random.default_rng(4)
    stacked, _, slots, *_ = _grouped_case(rng)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f_a"], [35, 1], [1, 1])
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        out = grouped_pooled_lookup(stacked, kjt, slots[:1])
    assert not np.any(np.asarray(out[0]))
    np.testing.assert_allclose(out[1, 0], np.asarray(stacked[1]), rtol=1e-6)
    assert "id 35" in caplog.text
