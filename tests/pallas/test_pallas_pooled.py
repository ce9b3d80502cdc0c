"""Pooled (table-batched) lookup kernel, interpreted, against its pure-jnp reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pallas_cases import LENGTHS, pooled_tolerance, ragged_case

from jaxrec.pallas import Tiling, pooled_lookup, pooled_lookup_reference, ranges_from_segments


@pytest.mark.parametrize(
    "dim,dtype,weighted,mean",
    [
        (12, "fp32", False, False),  # dim a multiple of 4, not a power of two
        (16, "fp32", True, True),  # weighted MEAN
        (20, "bf16", True, False),  # bf16 table, fp32 accumulation
        (8, "fp16", False, True),
    ],
)
def test_matches_reference_on_ragged_bags(dim, dtype, weighted, mean):
    w, rows, starts, ends, scale, _, lengths = ragged_case(
        0, dim=dim, dtype=dtype, weighted=weighted
    )
    got = pooled_lookup(w, rows, starts, ends, scale, mean=mean, interpret=True)
    want = pooled_lookup_reference(w, rows, starts, ends, scale, mean=mean)
    assert got.dtype == jnp.float32 and got.shape == (len(LENGTHS), dim)
    np.testing.assert_allclose(got, want, atol=pooled_tolerance(w, scale, max(lengths)), rtol=0)
    assert not np.any(np.asarray(got)[np.asarray(lengths) == 0])  # empty bags are zero
    # bag 8 holds one id five times: exactly 5 (or 1 for MEAN) times that row, up to rounding
    np.testing.assert_allclose(
        got[8],
        (1 if mean else 5) * w[3].astype(jnp.float32) if not weighted else want[8],
        rtol=1e-6,
    )


def test_segment_ids_skip_padding_and_foreign_positions():
    w, rows, starts, ends, scale, seg, _ = ragged_case(
        1, dim=12, dtype="fp32", weighted=True, padding=5
    )
    s2, e2 = ranges_from_segments(seg, len(LENGTHS))
    np.testing.assert_array_equal(e2 - s2, np.asarray(ends - starts))
    # Overlapping ranges (every bag claims the whole buffer): segment ids keep it exact.
    full_s = jnp.zeros_like(starts)
    full_e = jnp.full_like(ends, rows.shape[0])
    got = pooled_lookup(
        w, rows, full_s, full_e, scale, seg, tiling=Tiling(block_rows=4), interpret=True
    )
    want = pooled_lookup_reference(w, rows, starts, ends, scale)
    np.testing.assert_allclose(got, want, atol=pooled_tolerance(w, scale, 37), rtol=0)


def test_validation_errors():
    w = jnp.zeros((4, 8))
    ids, off = jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(NotImplementedError, match="dim % 4"):
        pooled_lookup(jnp.zeros((4, 6)), ids, off, off, interpret=True)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        pooled_lookup(w.astype(jnp.int32), ids, off, off, interpret=True)
    with pytest.raises(ValueError, match="ends must be"):
        pooled_lookup(w, ids, off, off[:1], interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        Tiling(block_rows=6)
    empty = pooled_lookup(w, ids[:0], off, off, interpret=True)
    assert empty.shape == (2, 8) and not np.any(np.asarray(empty))


@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=6, max_size=6), st.integers(0, 2**31 - 1))
def test_random_lengths_same_shapes(lengths, seed):
    """Any split of a fixed 24-slot buffer into 6 bags (one compile for all examples)."""
    rng = np.random.default_rng(seed)
    ends = np.minimum(np.cumsum(lengths), 24)
    starts = np.minimum(ends - np.asarray(lengths), 24).clip(0)
    w = jnp.asarray(rng.normal(size=(10, 12)), jnp.float32)
    rows = jnp.asarray(rng.integers(0, 10, 24), jnp.int32)
    starts, ends = jnp.asarray(starts, jnp.int32), jnp.asarray(ends, jnp.int32)
    got = pooled_lookup(w, rows, starts, ends, interpret=True)
    want = pooled_lookup_reference(w, rows, starts, ends)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
