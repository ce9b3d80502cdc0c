"""Fused sparse backward + optimizer update, in place, as a Pallas kernel.

Exact semantics (FBGEMM's EXACT_*): every touched row gets one update with the
sum of all its occurrences' gradients. Occurrences are grouped into *runs*,
one per unique row (a sort, done by XLA before the launch). Runs longer than
``piece_len`` are first summed in pieces by parallel programs
(``jaxrec.pallas.runs``: reduction launches writing float32 partial rows), so
no program's serial work grows with a hot row's count. The update launch's
programs each own ``block_rows`` runs, sum their items (occurrences read from
the output gradient directly, so no ``[C, D]`` per-id gradient is
materialised, or partial rows) in float32, then apply the optimizer's own row
update (``jaxrec.optim``, traced into the kernel) and write the rows back into
the table and state buffers, which are aliased input -> output
(``input_output_aliases``): untouched rows are never read or written, and
with donated buffers nothing is copied.

Two entry points share the kernel:

* :func:`sparse_update`: rows already unique and gradients summed (the train
  step's ``dedup_rows`` output); one occurrence per run.
* :func:`fused_backward_update`: from the output gradient, per-id output rows,
  scales and table rows: sorts, forms runs and updates in one launch.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..optim.base import SparseOptimizer, SparseOptState, apply_rows, row_fields
from ..xla.backward import backward_update_xla
from .runs import DEFAULT_PIECE_LEN, PieceLayout, RunPlan, piece_layout, plan_runs
from .tiling import Tiling, check_table, check_vector, next_pow2
from .triton_backend import pl_triton

DEFAULT_TILING = Tiling(block_rows=8, num_warps=4, num_stages=2)


def sparse_update_kernel(
    *refs,
    optimizer,
    state_type,
    fields,
    num_runs,
    num_rows,
    num_state_rows,
    dim,
    block_runs,
    runs,
    partials,
):
    """One optimizer step over ``block_runs`` unique rows.

    Refs, in order: ``grad_src [N, D] f32``, ``run_rows [U] i32`` (table row,
    ``>= R`` skips), ``run_state_rows [U] i32``, ``count [1] i32``, then when
    ``runs``: ``run_start [U] i32``, ``run_length [U] i32``, ``occ_src [M] i32``
    (grad_src row of each sorted occurrence), ``occ_scale [M] f32``, and when
    ``partials`` also ``run_partial [U] i32`` (1: the run's items are rows of
    the partial buffer, else sorted occurrences) and the partial buffer
    ``[P, D] f32``; then the table ``[R, D]`` and one ref per state field
    (``[R_s, D]`` or ``[R_s]``) as inputs, and the same again as (aliased)
    outputs.
    """
    k = len(fields)
    grad_ref, rows_ref, srows_ref, count_ref, *rest = refs
    if runs:
        start_ref, length_ref, src_ref, scale_ref, *rest = rest
    if partials:
        partial_ref, part_buf_ref, *rest = rest
    rest = rest[1 + k :]  # skip the aliased inputs: read and write through the outputs
    table_ref, state_refs = rest[0], rest[1:]
    u = pl.program_id(0) * block_runs + jnp.arange(block_runs, dtype=jnp.int32)
    ok = u < num_runs
    cols = jnp.arange(next_pow2(dim), dtype=jnp.int32)
    col_ok = cols < dim
    row = pl_triton.load(rows_ref.at[u], mask=ok, other=num_rows)
    srow = pl_triton.load(srows_ref.at[u], mask=ok, other=num_state_rows)
    live = ok & (row >= 0) & (row < num_rows) & (srow >= 0) & (srow < num_state_rows)
    # Skipped lanes keep out-of-range indices (see pooled.py): never clamped.
    row = jnp.where(live, row, num_rows)
    srow = jnp.where(live, srow, num_state_rows)
    m2 = live[:, None] & col_ok[None, :]
    if runs:
        start = pl_triton.load(start_ref.at[u], mask=live, other=0)
        length = pl_triton.load(length_ref.at[u], mask=live, other=0)
        items = _Items(grad_ref, src_ref, scale_ref, part_buf_ref if partials else None)
        g = jnp.zeros((block_runs, cols.shape[0]), jnp.float32)
        if partials:
            part = pl_triton.load(partial_ref.at[u], mask=live, other=0) > 0
            g = items.sum(g, start, jnp.where(part, 0, length), cols, col_ok, partial=False)
            g = items.sum(g, start, jnp.where(part, length, 0), cols, col_ok, partial=True)
        else:
            g = items.sum(g, start, length, cols, col_ok, partial=False)
    else:
        g = pl_triton.load(grad_ref.at[u[:, None], cols[None, :]], mask=m2, other=0.0)
    w = pl_triton.load(table_ref.at[row[:, None], cols[None, :]], mask=m2, other=0.0)
    slices = {}
    for f, ref in zip(fields, state_refs, strict=True):
        if len(ref.shape) == 2:
            slices[f] = pl_triton.load(ref.at[srow[:, None], cols[None, :]], mask=m2, other=0.0)
        else:
            slices[f] = pl_triton.load(ref.at[srow], mask=live, other=0.0)
    count = count_ref[0]
    state_rows = state_type(**{"count": count, **slices})
    extra = {} if cols.shape[0] == dim else {"dim": dim}
    new_w, new_state = optimizer.update(w.astype(jnp.float32), g, state_rows, count, **extra)
    pl_triton.store(
        table_ref.at[row[:, None], cols[None, :]], new_w.astype(table_ref.dtype), mask=m2
    )
    for f, ref in zip(fields, state_refs, strict=True):
        val = getattr(new_state, f).astype(ref.dtype)
        if len(ref.shape) == 2:
            pl_triton.store(ref.at[srow[:, None], cols[None, :]], val, mask=m2)
        else:
            pl_triton.store(ref.at[srow], val, mask=live)


class _Items(NamedTuple):
    """Where a run's or piece's items are read: sorted occurrences or partial rows."""

    grad_ref: Any  # [N, D] f32 output gradient
    src_ref: Any  # [M] i32 grad row of each sorted occurrence
    scale_ref: Any  # [M] f32 its multiplier
    partial_ref: Any  # [P, D] f32 partial sums (None when there are none)

    def sum(self, acc, start, length, cols, col_ok, partial: bool):
        """``acc`` plus each lane's items ``[start, start + length)``, in order.

        One lane's items are all occurrences or all partial rows; a launch
        with both kinds runs two loops (one live tile each: fewer registers).
        """

        def body(j, acc):
            on = j < length
            pos = jnp.where(on, start + j, 0)
            mask = on[:, None] & col_ok[None, :]
            if partial:
                item = self.partial_ref.at[pos[:, None], cols[None, :]]
                return acc + pl_triton.load(item, mask=mask, other=0.0)
            src = pl_triton.load(self.src_ref.at[pos], mask=on, other=0)
            sc = pl_triton.load(self.scale_ref.at[pos], mask=on, other=0.0)
            g = pl_triton.load(self.grad_ref.at[src[:, None], cols[None, :]], mask=mask, other=0.0)
            return acc + g * sc[:, None]

        return jax.lax.fori_loop(0, jnp.max(length), body, acc)


def piece_sum_kernel(
    grad_ref,
    src_ref,
    scale_ref,
    start_ref,
    length_ref,
    _partial_in,
    partial_ref,
    *,
    num_pieces,
    offset,
    dim,
    block_pieces,
    from_occurrences,
):
    """Sums ``block_pieces`` pieces into partial rows ``offset + piece``.

    Refs: ``grad [N, D] f32``, ``occ_src [M] i32``, ``occ_scale [M] f32``,
    ``piece_start [K] i32``, ``piece_length [K] i32`` (0: empty slot), then the
    partial buffer ``[P, D] f32`` as input and (aliased) output. Items are
    sorted occurrences (``from_occurrences``) or rows of the partial buffer
    written by the previous level's launch.
    """
    piece = pl.program_id(0) * block_pieces + jnp.arange(block_pieces, dtype=jnp.int32)
    ok = piece < num_pieces
    cols = jnp.arange(next_pow2(dim), dtype=jnp.int32)
    col_ok = cols < dim
    start = pl_triton.load(start_ref.at[piece], mask=ok, other=0)
    length = pl_triton.load(length_ref.at[piece], mask=ok, other=0)
    items = _Items(grad_ref, src_ref, scale_ref, partial_ref)
    acc = jnp.zeros((block_pieces, cols.shape[0]), jnp.float32)
    acc = items.sum(acc, start, length, cols, col_ok, partial=not from_occurrences)
    out = ok & (length > 0)
    dest = jnp.where(out, offset + piece, partial_ref.shape[0])
    pl_triton.store(
        partial_ref.at[dest[:, None], cols[None, :]], acc, mask=out[:, None] & col_ok[None, :]
    )


def _check_optimizer(optimizer, state, dim):
    if not isinstance(optimizer, SparseOptimizer):
        raise TypeError(f"optimizer must be a jaxrec.optim SparseOptimizer, got {optimizer!r}")
    if next_pow2(dim) != dim and "dim" not in inspect.signature(optimizer.update).parameters:
        raise NotImplementedError(
            f"{optimizer.name}'s update takes no dim= keyword, needed for dim={dim} "
            "(padded to a power of two)"
        )
    for f in row_fields(state):
        x = getattr(state, f)
        if x.dtype != jnp.float32 or x.ndim not in (1, 2) or (x.ndim == 2 and x.shape[1] != dim):
            raise NotImplementedError(
                f"state field {f!r} must be float32 [rows] or [rows, {dim}], got "
                f"{x.dtype}{list(x.shape)}"
            )


def _launch(
    optimizer,
    table,
    state,
    grad_src,
    run_rows,
    run_state_rows,
    tiling,
    interpret,
    plan: RunPlan | None = None,
    partials: jax.Array | None = None,
):
    """The update launch: one summed gradient per row (no ``plan``), or each run of
    ``plan`` summed from its occurrences and, where given, ``partials`` rows."""
    dim = table.shape[1]
    fields = row_fields(state)
    num_state_rows = getattr(state, fields[0]).shape[0] if fields else table.shape[0]
    count = state.count + 1
    u = run_rows.shape[0]
    kernel = functools.partial(
        sparse_update_kernel,
        optimizer=optimizer,
        state_type=type(state),
        fields=fields,
        num_runs=u,
        num_rows=table.shape[0],
        num_state_rows=num_state_rows,
        dim=dim,
        block_runs=tiling.block_rows,
        runs=plan is not None,
        partials=partials is not None,
    )
    inputs = [grad_src.astype(jnp.float32), run_rows, run_state_rows, count.reshape(1)]
    if plan is not None:
        inputs += [plan.start, plan.length, plan.src, plan.scale]
    if partials is not None:
        assert plan is not None  # partials are a plan's reductions
        inputs += [plan.partial, partials]
    buffers = [table] + [getattr(state, f) for f in fields]
    first = len(inputs)
    out = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers],
        grid=(pl.cdiv(u, tiling.block_rows),),
        input_output_aliases={first + i: i for i in range(len(buffers))},
        compiler_params=tiling.compiler_params(),
        interpret=interpret,
        name="jaxrec_sparse_update",
    )(*inputs, *buffers)
    new_state = state._replace(count=count, **dict(zip(fields, out[1:], strict=True)))
    return out[0], new_state


def _reduce(grad, plan: RunPlan, layout: PieceLayout, tiling, interpret) -> jax.Array:
    """The partial buffer ``[layout.total, D] f32``: one launch per reduction level.

    The first launch creates the buffer (no memset: a row is read only after
    the launch that writes it), later ones update it in place.
    """
    dim = grad.shape[1]
    partials = None
    for level, (pieces, size, offset) in enumerate(
        zip(plan.levels, layout.sizes, layout.offsets, strict=True)
    ):
        kernel = functools.partial(
            piece_sum_kernel,
            num_pieces=size,
            offset=offset,
            dim=dim,
            block_pieces=tiling.block_rows,
            from_occurrences=level == 0,
        )
        inputs = [grad, plan.src, plan.scale, pieces.start, pieces.length]
        partials = pl.pallas_call(
            kernel if level else _fresh(kernel),
            out_shape=jax.ShapeDtypeStruct((layout.total, dim), jnp.float32),
            grid=(pl.cdiv(size, tiling.block_rows),),
            input_output_aliases={5: 0} if level else {},
            compiler_params=tiling.compiler_params(),
            interpret=interpret,
            name="jaxrec_piece_sum",
        )(*inputs, *([partials] if level else []))
    assert partials is not None  # called with at least one level
    return partials


def _fresh(kernel):
    """``kernel`` for the first level: no partial buffer comes in."""

    def wrapped(grad, src, scale, start, length, out):
        return kernel(grad, src, scale, start, length, None, out)

    return wrapped


@functools.partial(jax.jit, static_argnames=("optimizer", "tiling", "interpret"))
def sparse_update(
    optimizer: SparseOptimizer,
    table: jax.Array,
    state: SparseOptState,
    rows: jax.Array,
    grads: jax.Array,
    state_rows: jax.Array | None = None,
    *,
    tiling: Tiling = DEFAULT_TILING,
    interpret: bool = False,
) -> tuple[jax.Array, SparseOptState]:
    """One optimizer step on unique ``rows`` of ``table``, in place (``apply_rows`` as a kernel).

    Args:
        optimizer: a ``jaxrec.optim`` sparse optimizer (static; its row update
            runs inside the kernel).
        table: ``[R, D]`` float32/float16/bfloat16 (``D % 4 == 0``).
        state: its state (per-row float32 fields ``[R_s, D]`` or ``[R_s]``).
        rows: ``[U]`` **unique** table rows (``dedup_rows`` output); rows outside
            ``[0, R)`` (the fill ``R``) are skipped.
        grads: ``[U, D]`` summed gradients.
        state_rows: ``[U]`` state rows of each row (default ``rows``), for
            optimizers that own part of a stacked buffer; out of range skips.
        tiling: static launch parameters (``block_rows`` rows per program).
        interpret: run in the Pallas interpreter.

    Returns:
        ``(table, state)`` updated, ``count`` advanced. Donate both to update
        in place.

    Raises:
        NotImplementedError: unsupported dim or state layout (callers fall back).
    """
    dim = check_table(table, "table")
    _check_optimizer(optimizer, state, dim)
    check_vector(rows, "rows")
    u = rows.shape[0]
    if grads.shape != (u, dim):
        raise ValueError(f"grads must be [{u}, {dim}], got grads.shape={grads.shape}")
    state_rows = rows if state_rows is None else state_rows
    check_vector(state_rows, "state_rows", u)
    if u == 0:
        return table, state._replace(count=state.count + 1)
    rows, state_rows = rows.astype(jnp.int32), state_rows.astype(jnp.int32)
    return _launch(optimizer, table, state, grads, rows, state_rows, tiling, interpret)


@functools.partial(jax.jit, static_argnames=("optimizer", "tiling", "piece_len", "interpret"))
def fused_backward_update(
    optimizer: SparseOptimizer,
    table: jax.Array,
    state: SparseOptState,
    out_grad: jax.Array,
    segment_ids: jax.Array,
    scale: jax.Array,
    rows: jax.Array,
    valid: jax.Array,
    *,
    tiling: Tiling = DEFAULT_TILING,
    piece_len: int | None = DEFAULT_PIECE_LEN,
    interpret: bool = False,
) -> tuple[jax.Array, SparseOptState]:
    """Backward of a lookup fused with the optimizer step, exact and in place.

    Occurrence ``c`` contributes ``out_grad[segment_ids[c]] * scale[c]`` to
    table row ``rows[c]`` (the per-id gradient of ``pooled_row_grads``); the
    contributions of each row are summed, then each touched row is updated once.
    Occurrences are sorted by row once; runs longer than ``piece_len`` are
    summed in pieces by parallel programs first (``jaxrec.pallas.runs``), so
    no program's serial work grows with a hot row's count.

    Args:
        optimizer: a ``jaxrec.optim`` sparse optimizer (static).
        table: ``[R, D]`` table; ``state``: its optimizer state.
        out_grad: ``[S, D]`` gradient of the lookup output (any float dtype).
        segment_ids: ``[C]`` output row of each occurrence (in ``[0, S)`` where valid).
        scale: ``[C]`` float multiplier (per-sample weight, 1/length for MEAN).
        rows: ``[C]`` table rows; ``valid``: ``[C]`` bool, False skips.
        tiling, interpret: as :func:`sparse_update`.
        piece_len: most occurrences (or partial sums) one program adds for one
            row; ``None`` walks every run whole in one program (the schedule
            before load balancing, kept for comparison).

    Returns:
        ``(table, state)`` updated, ``count`` advanced.
    """
    dim = check_table(table, "table")
    _check_optimizer(optimizer, state, dim)
    c = rows.shape[0]
    for name, x, kind in (("segment_ids", segment_ids, "iu"), ("rows", rows, "iu")):
        check_vector(x, name, c, kind)
    check_vector(scale, "scale", c, "f")
    check_vector(valid, "valid", c, "b")
    if out_grad.ndim != 2 or out_grad.shape[1] != dim:
        raise ValueError(f"out_grad must be [S, {dim}], got out_grad.shape={out_grad.shape}")
    if c == 0 or out_grad.shape[0] == 0:
        return table, state._replace(count=state.count + 1)
    layout = piece_layout(c, piece_len)
    plan = plan_runs(rows, valid, segment_ids, scale, table.shape[0], layout)
    grad = out_grad.astype(jnp.float32)
    partials = _reduce(grad, plan, layout, tiling, interpret) if layout.total else None
    return _launch(
        optimizer, table, state, grad, plan.row, plan.row, tiling, interpret, plan, partials
    )


def sparse_update_reference(optimizer, table, state, rows, grads, state_rows=None):
    """Pure-jnp :func:`sparse_update`: ``jaxrec.optim.apply_rows`` (shared state rows only)."""
    if state_rows is not None:
        raise NotImplementedError("the reference maps table rows to state rows 1:1")
    return apply_rows(optimizer, table, state, rows, grads)


def fused_backward_update_reference(
    optimizer, table, state, out_grad, segment_ids, scale, rows, valid
):
    """Pure-jnp :func:`fused_backward_update`: ``jaxrec.xla.backward.backward_update_xla``."""
    return backward_update_xla(optimizer, table, state, out_grad, segment_ids, scale, rows, valid)
