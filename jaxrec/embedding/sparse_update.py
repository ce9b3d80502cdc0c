"""Applies fused sparse optimizers to the rows one step touched (and resets state rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import Implementation
from ..ops.dispatch import dispatch
from ..optim.base import SparseOptState, apply_rows, row_fields
from ..xla.backward import backward_update_xla
from .optimizer import SubGroup


def update_subgroup(
    sub: SubGroup,
    row_offsets: tuple[int, ...],
    table: jax.Array,
    state: SparseOptState,
    rows: jax.Array,
    grads: jax.Array,
    *,
    implementation: Implementation = None,
) -> tuple[jax.Array, SparseOptState]:
    """One optimizer step on the subgroup's touched rows of a stacked buffer.

    Args:
        sub: the tables of the group this optimizer owns.
        row_offsets: static first row of each table of the group.
        table: ``[R, D]`` stacked buffer.
        state: the subgroup's optimizer state.
        rows: ``[U]`` unique rows (fill ``R``), ``grads``: ``[U, D]`` summed.
        implementation: ``None`` (the fused Pallas kernel on GPU, XLA elsewhere),
            ``"xla"``, ``"pallas"``, ``"cpu"`` or
            ``"mosaic_gpu"`` (no C++ kernel for this update: XLA).
    """
    table_rows, state_rows = subgroup_rows(sub, row_offsets, rows, table.shape[0])
    return dispatch(
        "sparse_update",
        implementation,
        apply_rows,
        sub.optimizer,
        table,
        state,
        table_rows,
        grads,
        state_rows,
    )


def subgroup_rows(
    sub: SubGroup, row_offsets: tuple[int, ...], rows: jax.Array, num_rows: int
) -> tuple[jax.Array, jax.Array]:
    """``(table_rows, state_rows)`` of group rows ``rows`` ``[U]`` for one subgroup.

    Rows of tables the subgroup does not own, and fill rows (``>= num_rows``,
    the group's rows), become fill: ``num_rows`` and ``sub.num_rows``.
    """
    if sub.covers_group:
        return rows, rows
    starts = jnp.asarray(np.asarray(row_offsets, np.int32))
    t = jnp.clip(jnp.searchsorted(starts, rows, side="right") - 1, 0, len(starts) - 1)
    member = jnp.asarray(np.asarray(sub.member))[t] & (rows < num_rows)
    local = rows - starts[t] + jnp.asarray(np.asarray(sub.state_offsets, np.int32))[t]
    return jnp.where(member, rows, num_rows), jnp.where(member, local, sub.num_rows)


def backward_update(
    optimizer,
    table: jax.Array,
    state: SparseOptState,
    out_grad: jax.Array,
    seg: jax.Array,
    scale: jax.Array,
    rows: jax.Array,
    valid: jax.Array,
    *,
    implementation: Implementation = None,
) -> tuple[jax.Array, SparseOptState]:
    """A lookup's backward fused with one optimizer step over a whole stacked buffer.

    Id ``c`` adds ``out_grad[seg[c]] * scale[c]`` to row ``rows[c]`` (see
    ``jaxrec.xla.backward.pooled_grad_sources``); duplicates are summed before
    one update per row. On GPU (``implementation=None``) the Pallas kernel
    reads the output gradient directly, never forming per-id gradients.
    """
    return dispatch(
        "fused_backward_update",
        implementation,
        backward_update_xla,
        optimizer,
        table,
        state,
        out_grad,
        seg,
        scale,
        rows,
        valid,
    )


def reset_state_rows(
    sub: SubGroup, state: SparseOptState, rows: jax.Array, dim: int
) -> SparseOptState:
    """``state`` with its per-row fields at their initial values in ``rows`` ``[K]`` (state
    rows of the subgroup; fill ``>= sub.num_rows``); skipped when every row is fill."""
    fields = row_fields(state)
    if not fields:  # SGD: nothing per row
        return state
    fresh = sub.optimizer.init(1, dim)  # one row of initial values (tiny, constant-folded)

    def write(st):
        new = {}
        for f in fields:
            x = getattr(st, f)
            row = jnp.broadcast_to(getattr(fresh, f)[0], (rows.shape[0], *x.shape[1:]))
            new[f] = x.at[rows].set(row.astype(x.dtype), mode="drop")
        return st._replace(**new)

    return jax.lax.cond(jnp.any(rows < sub.num_rows), write, lambda st: st, state)
