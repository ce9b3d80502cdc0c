"""Sequence (unpooled) lookup kernel, interpreted, against its reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import ragged_case

from jaxrec.pallas import Tiling, sequence_lookup, sequence_lookup_reference


@pytest.mark.parametrize("dim,dtype", [(12, "fp32"), (20, "bf16")])
def test_matches_reference_with_padding(dim, dtype):
    w, rows, _, _, _, seg, lengths = ragged_case(2, dim=dim, dtype=dtype, weighted=False, padding=4)
    valid = seg < len(lengths)
    rows = rows.at[0].set(10_000)  # out of range: clamped, as XLA's gather
    got = sequence_lookup(w, rows, valid, tiling=Tiling(block_rows=8), interpret=True)
    want = sequence_lookup_reference(w, rows, valid)
    assert got.dtype == w.dtype and got.shape == (rows.shape[0], dim)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.any(np.asarray(got, np.float32)[-4:])  # padding positions are zero


def test_empty_and_unmasked():
    w = jnp.arange(32.0).reshape(4, 8)
    assert sequence_lookup(w, jnp.zeros((0,), jnp.int32), interpret=True).shape == (0, 8)
    rows = jnp.asarray([3, 3, 0], jnp.int32)
    np.testing.assert_array_equal(sequence_lookup(w, rows, interpret=True), w[rows])
