"""Mosaic GPU pooled lookup in Pallas's Mosaic GPU interpreter, against the reference.

The interpreter (``InterpretGPUParams``) simulates shared memory, the TMA
copies and the mbarriers: uninitialised shared memory reads as NaN, reads out
of bounds raise, every barrier phase must be awaited, and ``detect_races``
checks that no read of a stage overlaps the copies into it. It runs the
kernel as written except for its two lowering hints (layout casts, and
``plgpu.load``'s unoptimised load, read there as ``ref[...]``). A case costs
2-4 CPU-s, mostly compiling the interpreted program, which grows with
``block_bags`` (the issue code is unrolled over the bags), so these run 8
bags a program; 16 and 32 run compiled (test_pallas_gpu.py), lowered
(test_pallas_lowering.py) and deviceless (tests/gpu_compile).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import LENGTHS, pooled_tolerance, ragged_case

from jaxrec.pallas import pooled_lookup_reference
from jaxrec.pallas.mosaic_pooled import (
    MosaicTiling,
    block_cols_for,
    embedding_bag_mosaic,
    pooled_lookup_mosaic,
)
from jaxrec.xla.lookup import embedding_bag_xla


def _races_checked():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(detect_races=True)


def _races_found() -> bool:
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    return gpu_callbacks.get_races().races_found


def test_embedding_bag_adapter_and_gradient():
    """The ops adapter (segments -> ranges, padding ids dropped) and its XLA gradient;
    three stages in flight, checked for races."""
    w, rows, _, _, scale, seg, lengths = ragged_case(
        0, dim=32, dtype="fp32", weighted=True, padding=5
    )
    n = len(LENGTHS)
    rows = rows.at[:3].set(jnp.asarray([-4, 64, 1000]))  # out of range: clamped
    cot = jnp.asarray(np.random.default_rng(0).normal(size=(n, 32)), jnp.float32)

    def loss(fn, w):
        out = fn(w)
        return jnp.sum(out * cot), out

    tiling = MosaicTiling(num_stages=3)
    kernel = lambda w: embedding_bag_mosaic(
        w, rows, seg, n, scale, interpret=_races_checked(), tiling=tiling
    )
    xla = lambda w: embedding_bag_xla(w, rows, seg, n, scale)
    (_, got), grad = jax.value_and_grad(lambda w: loss(kernel, w), has_aux=True)(w)
    (_, want), want_grad = jax.value_and_grad(lambda w: loss(xla, w), has_aux=True)(w)
    assert got.dtype == jnp.float32 and got.shape == (n, 32)
    np.testing.assert_allclose(got, want, atol=pooled_tolerance(w, scale, max(lengths)), rtol=0)
    assert not np.any(np.asarray(got)[lengths == 0])  # empty bags are zero
    np.testing.assert_allclose(grad, want_grad, atol=1e-6, rtol=0)  # XLA's autodiff, both
    assert not _races_found()


def test_overlapping_ranges_and_column_blocks():
    """Ranges widened by 2 on each side (overlapping; the first starts at -2), kept
    exact by segment ids; two column blocks (a second grid axis); one stage."""
    w, rows, starts, ends, _, seg, lengths = ragged_case(1, dim=64, dtype="fp32", weighted=False)
    tiling = MosaicTiling(block_bags=8, block_cols=32, num_stages=1)
    args = (w, rows, starts - 2, ends + 2, None, seg)
    got = pooled_lookup_mosaic(*args, tiling=tiling, interpret=True)
    want = pooled_lookup_reference(w, rows, starts, ends)
    np.testing.assert_allclose(got, want, atol=pooled_tolerance(w, jnp.ones(1), 37), rtol=0)
    assert not np.any(np.asarray(got)[lengths == 0])
    np.testing.assert_allclose(got[8], 5 * w[3], rtol=1e-6)  # bag 8: one id five times


def test_bf16_mean_at_default_tiling():
    """A bf16 table (float32 accumulation), per-id weights, MEAN; 8 bags x 8 positions."""
    w, rows, starts, ends, scale, _, lengths = ragged_case(2, dim=64, dtype="bf16", weighted=True)
    got = pooled_lookup_mosaic(w, rows, starts, ends, scale, mean=True, interpret=True)
    want = pooled_lookup_reference(w, rows, starts, ends, scale, mean=True)
    np.testing.assert_allclose(got, want, atol=pooled_tolerance(w, scale, max(lengths)), rtol=0)
    assert not np.any(np.asarray(got)[lengths == 0])


def test_validation_errors():
    ids, off = jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32)
    for shape, dtype in [((4, 16), jnp.float32), ((4, 32), jnp.bfloat16), ((4, 96), jnp.float16)]:
        with pytest.raises(NotImplementedError, match="128-byte"):
            pooled_lookup_mosaic(jnp.zeros(shape, dtype), ids, off, off, interpret=True)
    with pytest.raises(NotImplementedError, match="dim % 4"):
        pooled_lookup_mosaic(jnp.zeros((4, 6)), ids, off, off, interpret=True)
    with pytest.raises(NotImplementedError, match="128-byte"):  # the adapter raises too
        embedding_bag_mosaic(jnp.zeros((4, 16)), ids, ids, 2, interpret=True)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        pooled_lookup_mosaic(jnp.zeros((4, 32), jnp.int32), ids, off, off, interpret=True)
    with pytest.raises(ValueError, match="block_bags"):
        MosaicTiling(block_bags=12)
    wide = jnp.zeros((4, 256))
    with pytest.raises(ValueError, match="must divide"):
        block_cols_for(wide, MosaicTiling(block_cols=96))
    with pytest.raises(ValueError, match="shared memory"):
        block_cols_for(wide, MosaicTiling(block_cols=256, num_stages=4))
    assert block_cols_for(wide) == 128 and block_cols_for(jnp.zeros((4, 96))) == 96
    assert block_cols_for(jnp.zeros((4, 192), jnp.bfloat16)) == 64
    empty = pooled_lookup_mosaic(jnp.zeros((4, 32)), ids[:0], off, off, interpret=True)
    assert empty.shape == (2, 32) and not np.any(np.asarray(empty))
