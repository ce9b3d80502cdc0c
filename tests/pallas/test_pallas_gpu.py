"""Compiled (non-interpreted) kernels on a GPU: the same checks as the interpret tests.

Skipped without a GPU backend; run on the GPU machine with
``python -m pytest tests/pallas``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import LENGTHS, on_gpu, pooled_tolerance, ragged_case

from jaxrec import optim
from jaxrec.ops import pooled_lookup as ops_pooled_lookup
from jaxrec.pallas import (
    fused_backward_update,
    fused_backward_update_reference,
    pooled_lookup,
    pooled_lookup_reference,
    sequence_lookup,
    sequence_lookup_reference,
)
from jaxrec.pallas.mosaic_pooled import MosaicTiling, embedding_bag_mosaic, pooled_lookup_mosaic
from jaxrec.xla.lookup import embedding_bag_xla

pytestmark = pytest.mark.skipif(
    not on_gpu(), reason=f"needs a GPU backend (jax.default_backend() is {jax.default_backend()!r})"
)


@pytest.mark.parametrize("dim,dtype,mean", [(12, "fp32", False), (128, "bf16", True)])
def test_pooled_lookup_compiled(dim, dtype, mean):
    w, rows, starts, ends, scale, seg, lengths = ragged_case(
        0, dim=dim, dtype=dtype, weighted=True, padding=3
    )
    got = pooled_lookup(w, rows, starts, ends, scale, seg, mean=mean)
    want = pooled_lookup_reference(w, rows, starts, ends, scale, seg, mean=mean)
    np.testing.assert_allclose(got, want, atol=pooled_tolerance(w, scale, max(lengths)), rtol=0)


def _sm90_or_newer() -> bool:
    cap = getattr(jax.devices()[0], "compute_capability", "0")
    return float(cap) >= 9.0


# Every tiling knob at least once: bags per program (2 to 8 positions per step),
# pipelining depth, column blocks, Mosaic's automatic barriers or one per step.
MOSAIC_CASES = [
    (32, "fp32", False, False, MosaicTiling()),
    (128, "bf16", True, True, MosaicTiling()),
    (128, "fp32", True, False, MosaicTiling(block_bags=32, num_stages=1)),
    (256, "fp16", False, True, MosaicTiling(block_bags=16, block_cols=64, num_stages=4)),
    (64, "bf16", True, False, MosaicTiling(block_bags=32, manual_barriers=True)),
    (512, "fp32", True, True, MosaicTiling(block_bags=8, num_stages=3, manual_barriers=True)),
]


@pytest.mark.parametrize("dim,dtype,segments,mean,tiling", MOSAIC_CASES)
def test_pooled_lookup_mosaic_compiled(dim, dtype, segments, mean, tiling):
    """The Mosaic GPU kernel (sm_90+) against the reference; overlapping ranges with segments."""
    if not _sm90_or_newer():
        pytest.skip(f"Mosaic GPU needs sm_90+, got {jax.devices()[0].device_kind}")
    w, rows, starts, ends, scale, seg, lengths = ragged_case(
        0, dim=dim, dtype=dtype, weighted=True, padding=3
    )
    if segments:  # widen every range: positions of other bags inside are skipped
        starts, ends = starts - 3, ends + 3
    else:
        seg = None
    got = pooled_lookup_mosaic(w, rows, starts, ends, scale, seg, mean=mean, tiling=tiling)
    want = pooled_lookup_reference(w, rows, starts, ends, scale, seg, mean=mean)
    assert got.shape == (len(LENGTHS), dim) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=pooled_tolerance(w, scale, max(lengths)), rtol=0)


def test_pooled_lookup_mosaic_compiled_at_batch_size():
    """Many programs, ids out of range (clamped), dropped ids, the adapter and its gradient."""
    if not _sm90_or_newer():
        pytest.skip(f"Mosaic GPU needs sm_90+, got {jax.devices()[0].device_kind}")
    n, c, r, d = 4099, 40_000, 100_000, 128  # n % 8 != 0: a partial last block
    k = jax.random.split(jax.random.key(1), 4)
    w = jax.random.normal(k[0], (r, d))
    rows = jax.random.randint(k[1], (c,), -5, r + 5)
    seg = jnp.sort(jax.random.randint(k[2], (c,), 0, n + 1))  # n: padding ids
    scale = jnp.where(jax.random.uniform(k[3], (c,)) < 0.1, 0.0, 1.5)
    kernel = jax.jit(lambda w: embedding_bag_mosaic(w, rows, seg, n, scale, interpret=False))
    xla = jax.jit(lambda w: embedding_bag_xla(w, rows, seg, n, scale))
    np.testing.assert_allclose(kernel(w), xla(w), atol=1e-4, rtol=1e-5)
    cot = jax.random.normal(k[0], (n, d))
    grad = jax.grad(lambda w: jnp.sum(kernel(w) * cot))(w)
    want = jax.grad(lambda w: jnp.sum(xla(w) * cot))(w)
    np.testing.assert_allclose(grad, want, atol=1e-5, rtol=1e-5)  # scatter-add order


def test_sequence_lookup_compiled():
    w, rows, _, _, _, seg, _ = ragged_case(1, dim=20, dtype="fp16", weighted=False, padding=3)
    valid = seg < len(LENGTHS)
    np.testing.assert_array_equal(
        sequence_lookup(w, rows, valid), sequence_lookup_reference(w, rows, valid)
    )


@pytest.mark.parametrize(
    "opt", [optim.sgd(0.1), optim.rowwise_adagrad(0.1), optim.adam(0.01)], ids=lambda o: o.name
)
def test_fused_backward_update_compiled(opt):
    w, rows, _, _, scale, seg, _ = ragged_case(2, dim=20, dtype="fp32", weighted=True, padding=3)
    valid = seg < len(LENGTHS)
    out_grad = jax.random.normal(jax.random.key(0), (len(LENGTHS), 20))
    state = opt.init(w.shape[0], 20)
    got = fused_backward_update(opt, w, state, out_grad, seg, scale, rows, valid)
    want = fused_backward_update_reference(opt, w, state, out_grad, seg, scale, rows, valid)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_default_dispatch_uses_the_kernel_on_gpu():
    t = jnp.ones((10, 8))
    text = jax.jit(lambda t: ops_pooled_lookup(t, jnp.array([1, 2]), jnp.array([2]))).lower(t)
    assert "triton" in text.as_text()


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("piece_len", [32, None])
def test_balanced_fused_backward_compiled_on_skewed_ids(name, piece_len):
    """Zipf 1.2 ids (a hot row of thousands): both schedules against float64 numpy."""
    import numpy_optimizers as ref

    rng = np.random.default_rng(5)
    c, rows, segments, dim = 100_000, 20_000, 4_096, 32
    ids = np.minimum(rng.zipf(1.2, c) - 1, rows - 1).astype(np.int32)
    seg = rng.integers(0, segments, c).astype(np.int32)
    scale = rng.random(c).astype(np.float32)
    valid = rng.random(c) > 0.05
    table = rng.normal(size=(rows, dim)).astype(np.float32)
    grad = rng.normal(size=(segments, dim)).astype(np.float32)
    opt = {"sgd": optim.sgd, "rowwise_adagrad": optim.rowwise_adagrad, "adam": optim.adam}[name]
    got_t, got_s = fused_backward_update(
        opt(0.01),
        jnp.asarray(table),
        opt(0.01).init(rows, dim),
        jnp.asarray(grad),
        seg,
        scale,
        ids,
        valid,
        piece_len=piece_len,
    )
    counts = np.bincount(ids[valid], minlength=rows)
    touched = np.flatnonzero(counts)
    summed = np.zeros((rows, dim))
    np.add.at(summed, ids[valid], grad[seg[valid]].astype(np.float64) * scale[valid, None])
    want_t, want_s = ref.apply_rows(
        name, table, ref.init_state(name, rows, dim), touched, summed[touched], 1, 0.01
    )
    # Rounding of float32 sums moves a row by ~1e-7; one lost id by lr * |g * scale|, ~1e-3.
    np.testing.assert_allclose(np.asarray(got_t), want_t, rtol=1e-5, atol=1e-5)
    for f, want in want_s.items():
        np.testing.assert_allclose(np.asarray(getattr(got_s, f)), want, rtol=1e-4, atol=1e-6)
