"""The fused update of a width group's shards, exact however many exchange rounds ran.

Fast path (no device needed more than round 0): de-duplicate round 0's row
gradients and update once, as an unsharded collection does.

Overflow path (some destination received more than ``C`` ids from some
source): a row's gradient may come in several rounds, and row-wise and Adam
state need the whole gradient in one update. Each pass picks, over every
round's ids, the ``K`` distinct rows of the smallest ``(logical row, local
row)`` keys, remembering the smallest logical row it had to drop (``cut``):
every row below ``cut`` was seen whole. All devices agree on ``hi =
min(cut)`` (so column shards of one table, which hold the same logical rows,
update the same rows in the same pass; see ``row_sums``), sum the gradients
of their rows below ``hi`` over the rounds again, update them and start the
next pass at ``hi``, until nothing was dropped. Memory stays that of the fast
path; an overflow costs time (rounds x passes), never correctness.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..xla.backward import dedup_rows
from .layout import WidthGroup

INF = np.iinfo(np.int32).max


def logical_rows(group: WidthGroup, axis) -> Callable[[jax.Array], jax.Array]:
    """``rows [U] -> [U]``: each local row's row number in its table (fill -> INF)."""
    n = len(group.shards)
    k = max(1, max(len(r) for r in group.shards))
    offs = np.full((n, k), group.rows_per_rank, np.int32)
    row0 = np.zeros((n, k), np.int32)
    for rank, shards in enumerate(group.shards):
        for i, s in enumerate(sorted(shards, key=lambda s: s.local_offset)):
            offs[rank, i], row0[rank, i] = s.local_offset, s.row0

    def logical(rows):
        me = jax.lax.axis_index(axis)
        o, r0 = jnp.asarray(offs)[me], jnp.asarray(row0)[me]
        j = jnp.clip(jnp.searchsorted(o, rows, side="right") - 1, 0, k - 1)
        return jnp.where(rows < group.rows_per_rank, rows - o[j] + r0[j], INF)

    return logical


def _smallest(buf, new1, new2, fill: int):
    """Keeps the ``size`` smallest distinct ``(logical, local)`` keys of the buffer and a
    round's keys, and lowers ``cut`` to the smallest logical row it had to drop."""
    keys1, keys2, cut = buf
    size = keys1.shape[0]
    s1, s2 = jax.lax.sort(
        (jnp.concatenate([keys1, new1]), jnp.concatenate([keys2, new2])), num_keys=2
    )
    first = jnp.concatenate([jnp.ones((1,), bool), (s1[1:] != s1[:-1]) | (s2[1:] != s2[:-1])])
    seg = jnp.where(s2 < fill, jnp.cumsum(first, dtype=jnp.int32) - 1, 2 * size)
    dropped = (s2 < fill) & (seg >= size)
    cut = jnp.minimum(cut, jnp.min(jnp.where(dropped, s1, INF)))
    out1 = jnp.full((size,), INF, jnp.int32).at[seg].set(s1, mode="drop")
    out2 = jnp.full((size,), fill, jnp.int32).at[seg].set(s2, mode="drop")
    return out1, out2, cut


# Round r's (rows [K], valid [K], grads) of a width group; grads() -> [K, D] float32.
RoundIds = tuple[jax.Array, jax.Array, Callable[[], jax.Array]]


def exact_update(
    update: Callable,
    table: jax.Array,
    state,
    round0: tuple[jax.Array, jax.Array, jax.Array],
    more: Callable[[jax.Array], RoundIds] | None,
    rounds: jax.Array | None,
    *,
    fill: int,
    size: int,
    logical: Callable,
    axis,
):
    """One optimizer step over every round's row gradients of a width group.

    Args:
        update: ``(table, state, rows [U], grads [U, D]) -> (table, state)``,
            one optimizer step (it advances ``state.count``).
        round0: round 0's ``rows [K]``, ``grads [K, D]`` float32, ``valid [K]``.
        more: ``r -> (rows, valid, grads)`` of round ``r`` (round 0 again too,
            inside the overflow loop), ``grads`` a function (called only when
            they are needed); it exchanges ids, so every device must call it
            alike. ``None`` (drop modes): only round 0.
        rounds: rounds any device needed (the same on every device); ``None``
            with ``more=None``.
        fill: the group's rows per rank (out-of-range row).
        size: distinct rows an overflow pass holds (more than the shards a rank
            holds, so every pass makes progress).
        logical: ``rows -> logical rows`` (:func:`logical_rows`).

    A pass first finds its rows from the ids alone (int32 keys), then sums
    their gradients into one ``[size, D]`` buffer, so the overflow path holds
    no more gradient memory than the fast path.
    """
    rows0, grads0, valid0 = round0
    if more is None or rounds is None:  # round 0 only
        if more is not None:
            raise ValueError("exact_update: more needs rounds (the rounds any device needed)")
        uniq, summed = dedup_rows(rows0, grads0, valid0, fill)
        return update(table, state, uniq, summed)
    uniq, summed = dedup_rows(rows0, grads0, valid0 & (rounds == 1), fill)
    table, state = update(table, state, uniq, summed)
    width = grads0.shape[1]

    def keys(rows, valid, lo):
        lg = logical(rows)
        take = valid & (rows < fill) & (lg >= lo)
        return jnp.where(take, lg, INF), jnp.where(take, rows, fill)

    def one_pass(carry):
        lo, table, state = carry
        # the rows of this pass: the `size` smallest keys >= lo over every round
        buf = (jnp.full((size,), INF, jnp.int32), jnp.full((size,), fill, jnp.int32), INF)

        def add_keys(r, b):
            r_rows, r_valid, _ = more(r)
            return _smallest(b, *keys(r_rows, r_valid, lo), fill)

        buf = jax.lax.fori_loop(0, rounds, add_keys, buf)
        keys1, keys2, cut = buf
        hi = jax.lax.pmin(cut, axis)  # every device stops at the same logical row
        rows = jnp.sort(jnp.where(keys1 < hi, keys2, fill))

        def add_round(r, acc):  # round 0 again too: its gradients are not kept alive
            r_rows, r_valid, r_grads = more(r)
            lg = logical(r_rows)
            mine = r_valid & (r_rows < fill) & (lg >= lo) & (lg < hi)
            at = jnp.where(mine, jnp.searchsorted(rows, r_rows), size)
            return acc.at[at].add(r_grads(), mode="drop")

        acc = jnp.zeros((size, width), jnp.float32)
        acc = jax.lax.fori_loop(0, rounds, add_round, acc)
        # the step was counted by the fast update above: passes reuse its count
        table, st = update(table, state._replace(count=state.count - 1), rows, acc)
        return hi, table, st

    start = jnp.where(rounds > 1, 0, INF).astype(jnp.int32)
    _, table, state = jax.lax.while_loop(lambda c: c[0] < INF, one_pass, (start, table, state))
    return table, state
