"""The dequantizing Pallas lookup: interpret mode vs its reference, CUDA lowering, dispatch,
compiled on a GPU (skipped without one)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from quant_cases import bags, jit_call, kjt, random_table, tables, weights_for

import jaxrec as jr
from jaxrec.inference import QuantEmbeddingBagCollection, quant_embedding_bag, quantize_rows
from jaxrec.pallas import Tiling, ranges_from_segments
from jaxrec.pallas.quant_lookup import quant_pooled_lookup, quant_pooled_lookup_reference

LENGTHS = (0, 1, 3, 0, 17, 2, 2, 0, 5, 1)  # empty bags first, middle and last-but-one
TABLE_ROWS = (24, 40)  # two stacked tables


def case(seed, dim, dtype, weighted, padding=3):
    """Bags alternate between two stacked tables; bag 5 repeats one id, bag 8 one id 5x."""
    rng = np.random.default_rng(seed)
    q = quantize_rows(random_table(seed, sum(TABLE_ROWS), dim, scale=2.0), dtype)
    lengths = np.asarray(LENGTHS)
    ends = np.cumsum(lengths)
    ids = []
    for b, n in enumerate(lengths):
        lo = 0 if b % 2 == 0 else TABLE_ROWS[0]
        bag = rng.integers(0, TABLE_ROWS[b % 2], n) + lo
        if b == 5:
            bag[:] = bag[0]
        if b == 8:
            bag[:] = lo + 3
        ids.append(bag)
    ids.append(rng.integers(0, sum(TABLE_ROWS), padding))
    rows = jnp.asarray(np.concatenate(ids), jnp.int32)
    seg = np.concatenate([np.repeat(np.arange(len(lengths)), lengths), np.full(padding, 99)])
    scale = rng.uniform(0.5, 2, rows.shape[0]) if weighted else np.ones(rows.shape[0])
    return (
        q,
        rows,
        jnp.asarray(ends - lengths, jnp.int32),
        jnp.asarray(ends, jnp.int32),
        jnp.asarray(scale, jnp.float32),
        jnp.asarray(seg, jnp.int32),
    )


@pytest.mark.parametrize(
    "dim,dtype,weighted,mean,segments",
    [
        (10, "int8", True, False, True),
        (6, "int4", False, True, False),
        (20, "int4", True, True, True),
    ],
)
def test_interpret_matches_reference(dim, dtype, weighted, mean, segments):
    q, rows, starts, ends, scale, seg = case(0, dim, dtype, weighted)
    seg = seg if segments else None
    kw = dict(dim=dim, dtype=dtype, mean=mean)
    got = quant_pooled_lookup(
        q, rows, starts, ends, scale, seg, interpret=True, tiling=Tiling(block_rows=4), **kw
    )
    want = quant_pooled_lookup_reference(q, rows, starts, ends, scale, seg, **kw)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert not np.asarray(got)[np.asarray(LENGTHS) == 0].any()  # empty bags: zeros


def test_kernel_validation():
    q, rows, starts, ends, scale, seg = case(1, 8, "int8", False)
    with pytest.raises(NotImplementedError, match="handles"):
        quant_pooled_lookup(q, rows, starts, ends, dim=8, dtype="fp16", interpret=True)
    with pytest.raises(ValueError, match="need"):
        quant_pooled_lookup(q, rows, starts, ends, dim=64, dtype="int8", interpret=True)
    with pytest.raises(TypeError, match="uint8"):
        quant_pooled_lookup(q.astype(jnp.float32), rows, starts, ends, dim=8, dtype="int8")


@pytest.mark.parametrize("dtype", ["int8"])
def test_dispatch_pallas_equals_xla(dtype):
    """``implementation="pallas"`` (interpreted on CPU) through the dispatcher and the module."""
    q, rows, _, _, scale, seg = case(2, 10, dtype, True)
    args = (q, rows, seg, len(LENGTHS), scale)
    xla = quant_embedding_bag(*args, dim=10, dtype=dtype, implementation="xla")
    pal = quant_embedding_bag(*args, dim=10, dtype=dtype, implementation="pallas")
    np.testing.assert_allclose(pal, xla, rtol=1e-5, atol=1e-4)
    if dtype == "int8":  # the whole module once: mixed dims, MEAN, weights, empty bags
        ebc = jr.EmbeddingBagCollection(tables(), is_weighted=True, rngs=nnx.Rngs(0))
        b = bags()
        features = kjt(b, weights_for(b))
        outs = [
            jit_call(
                QuantEmbeddingBagCollection.from_float(ebc, "int8", implementation=i), features
            ).values()
            for i in ("xla", "pallas")
        ]
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_fp16_rows_fall_back_to_xla():
    q = quantize_rows(random_table(3, 8, 4), "fp16")
    rows, seg = jnp.asarray([0, 7, 7]), jnp.asarray([0, 0, 1])
    got = quant_embedding_bag(q, rows, seg, 2, dim=4, dtype="fp16", implementation="pallas")
    want = quant_embedding_bag(q, rows, seg, 2, dim=4, dtype="fp16", implementation="xla")
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype,segments", [("int8", True), ("int4", False)])
def test_lowers_for_cuda(dtype, segments):
    q, rows, starts, ends, scale, seg = case(4, 20, dtype, True)
    fn = functools.partial(
        quant_pooled_lookup,
        dim=20,
        dtype=dtype,
        mean=not segments,
        tiling=Tiling(block_rows=16, num_warps=2),
    )
    text = jax.jit(fn).trace(q, rows, starts, ends, scale, seg if segments else None)
    text = text.lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")
@pytest.mark.parametrize("dim,dtype", [(12, "int8"), (128, "int4")])
def test_compiled_on_gpu(dim, dtype):
    q, rows, starts, ends, scale, seg = case(5, dim, dtype, True)
    got = quant_pooled_lookup(q, rows, starts, ends, scale, seg, dim=dim, dtype=dtype)
    want = quant_pooled_lookup_reference(q, rows, starts, ends, scale, seg, dim=dim, dtype=dtype)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    starts2, ends2 = ranges_from_segments(seg, len(LENGTHS))
    np.testing.assert_allclose(
        quant_pooled_lookup(q, rows, starts2, ends2, scale, seg, dim=dim, dtype=dtype),
        want,
        rtol=1e-5,
        atol=1e-4,
    )
