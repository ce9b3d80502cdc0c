"""Sequence (unpooled) lookup: ``out[c] = weights[rows[c]]`` or zeros, as a Pallas kernel.

Each program copies ``block_rows`` positions' rows (``[block_rows,
next_pow2(D)]``, surplus lanes masked) in the table's dtype. The XLA gather
may already be near the copy ceiling on GPU; ``bench/gpu_lookup.py`` measures
both so the default can follow the numbers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .tiling import Tiling, check_table, check_vector, next_pow2, out_struct
from .triton_backend import pl_triton

DEFAULT_TILING = Tiling(block_rows=16, num_warps=4, num_stages=2)


def sequence_lookup_kernel(
    weights_ref,  # [R, D] table dtype
    rows_ref,  # [C] int32; < 0 marks a padding position (zero output)
    out_ref,  # [C, D] table dtype
    *,
    num_positions: int,
    dim: int,
    block_positions: int,
):
    pos = pl.program_id(0) * block_positions + jnp.arange(block_positions, dtype=jnp.int32)
    ok = pos < num_positions
    cols = jnp.arange(next_pow2(dim), dtype=jnp.int32)
    col_ok = cols < dim
    row = pl_triton.load(rows_ref.at[pos], mask=ok, other=-1)
    live = ok & (row >= 0)
    emb = pl_triton.load(
        weights_ref.at[jnp.maximum(row, 0)[:, None], cols[None, :]],
        mask=live[:, None] & col_ok[None, :],
        other=0.0,
    )
    # Out-of-range lanes keep their indices (masked on GPU, dropped by the interpreter).
    pl_triton.store(
        out_ref.at[pos[:, None], cols[None, :]], emb, mask=ok[:, None] & col_ok[None, :]
    )


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def sequence_lookup(
    weights: jax.Array,
    rows: jax.Array,
    valid: jax.Array | None = None,
    *,
    tiling: Tiling = DEFAULT_TILING,
    interpret: bool = False,
) -> jax.Array:
    """``[C, D]`` rows of ``weights`` (table dtype); invalid positions are zero.

    Args:
        weights: ``[R, D]`` float32/float16/bfloat16 (``D % 4 == 0``).
        rows: ``[C]`` int rows, clamped into ``[0, R)`` as XLA's gather.
        valid: optional ``[C]`` bool; False gives a zero row.
        tiling: static launch parameters (``block_rows`` positions per program).
        interpret: run in the Pallas interpreter.

    Raises:
        NotImplementedError: ``D % 4 != 0``.
    """
    dim = check_table(weights)
    check_vector(rows, "rows")
    c = rows.shape[0]
    if valid is not None:
        check_vector(valid, "valid", c, "b")
    if c == 0 or weights.shape[0] == 0:
        return jnp.zeros((c, dim), weights.dtype)
    rows = jnp.clip(rows.astype(jnp.int32), 0, weights.shape[0] - 1)
    if valid is not None:
        rows = jnp.where(valid, rows, -1)
    kernel = functools.partial(
        sequence_lookup_kernel, num_positions=c, dim=dim, block_positions=tiling.block_rows
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_struct((c, dim), weights.dtype, weights, rows),
        grid=(pl.cdiv(c, tiling.block_rows),),
        compiler_params=tiling.compiler_params(),
        interpret=interpret,
        name="jaxrec_sequence_lookup",
    )(weights, rows)


def sequence_lookup_reference(weights, rows, valid=None) -> jax.Array:
    """Pure-jnp :func:`sequence_lookup`."""
    emb = jnp.take(weights, rows, axis=0, mode="clip")
    if valid is None:
        return emb
    return jnp.where(valid[:, None], emb, jnp.zeros((), emb.dtype))
