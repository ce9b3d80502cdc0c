"""The fused update of a width group's shards, exact however many exchange rounds ran.

Fast path (no device needed more than round 0): de-duplicate round 0's row
gradients and update once, as an unsharded collection does.

Overflow path (some destination received more than ``C`` ids from some
source): a row's gradient may come in several rounds, and row-wise and Adam
state need the whole gradient in one update. Passes over the rounds collect,
in a buffer of ``K`` distinct rows, the rows of the smallest *logical* row
numbers: merging a round keeps the ``K`` smallest ``(logical row, local row)``
keys and remembers the smallest logical row it had to drop (``cut``); every
row below ``cut`` then has all of its gradient. All devices agree on
``hi = min(cut)`` (so column shards of one table, which hold the same logical
rows, update the same rows in the same pass; see ``row_sums``), update the rows
below ``hi`` and start the next pass there, until nothing was dropped. Memory
stays ``O(K)``; an overflow costs time (rounds x passes), never correctness.
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
        for i, (_, r0, _, _, off) in enumerate(sorted(shards, key=lambda s: s[4])):
            offs[rank, i], row0[rank, i] = off, r0

    def logical(rows):
        me = jax.lax.axis_index(axis)
        o, r0 = jnp.asarray(offs)[me], jnp.asarray(row0)[me]
        j = jnp.clip(jnp.searchsorted(o, rows, side="right") - 1, 0, k - 1)
        return jnp.where(rows < group.rows_per_rank, rows - o[j] + r0[j], INF)

    return logical


def _merge(buf, rows, grads, valid, lo, logical, fill: int):
    """Adds one round's ``(rows, grads)`` with logical row ``>= lo`` to the buffer."""
    keys1, keys2, summed, cut = buf
    size = keys1.shape[0]
    lg = logical(rows)
    take = valid & (rows < fill) & (lg >= lo)
    new1 = jnp.where(take, lg, INF)
    new2 = jnp.where(take, rows, fill)
    k1 = jnp.concatenate([keys1, new1])
    k2 = jnp.concatenate([keys2, new2])
    s1, s2, perm = jax.lax.sort((k1, k2, jnp.arange(2 * size, dtype=jnp.int32)), num_keys=2)
    first = jnp.concatenate([jnp.ones((1,), bool), (s1[1:] != s1[:-1]) | (s2[1:] != s2[:-1])])
    seg = jnp.cumsum(first, dtype=jnp.int32) - 1
    real = s2 < fill
    seg = jnp.where(real, seg, 2 * size)
    dropped = real & (seg >= size)
    cut = jnp.minimum(cut, jnp.min(jnp.where(dropped, s1, INF)))
    inverse = jnp.zeros((2 * size,), jnp.int32).at[perm].set(seg)
    out1 = jnp.full((size,), INF, jnp.int32).at[seg].set(s1, mode="drop")
    out2 = jnp.full((size,), fill, jnp.int32).at[seg].set(s2, mode="drop")
    add = jax.ops.segment_sum(summed, inverse[:size], num_segments=size)
    add = add + jax.ops.segment_sum(
        jnp.where(take[:, None], grads, 0.0), inverse[size:], num_segments=size
    )
    return out1, out2, add, cut


def exact_update(
    update: Callable,
    table: jax.Array,
    state,
    round0: tuple[jax.Array, jax.Array, jax.Array],
    more: Callable | None,
    rounds: jax.Array,
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
        more: ``r -> (rows, grads, valid)`` of round ``r >= 1`` (it exchanges
            ids, so every device must call it alike), or ``None`` (drop modes:
            only round 0 exists).
        rounds: rounds any device needed (the same on every device).
        fill: the group's rows per rank (out-of-range row).
        size: distinct rows an overflow pass holds (``K``; more than the
            shards a rank holds).
        logical: ``rows -> logical rows`` (:func:`logical_rows`).
    """
    rows0, grads0, valid0 = round0
    fast = valid0 if more is None else valid0 & (rounds == 1)
    uniq, summed = dedup_rows(rows0, grads0, fast, fill)
    table, state = update(table, state, uniq, summed)
    if more is None:
        return table, state
    width = grads0.shape[1]

    def one_pass(carry):
        lo, table, state = carry
        empty = (
            jnp.full((size,), INF, jnp.int32),
            jnp.full((size,), fill, jnp.int32),
            jnp.zeros((size, width), jnp.float32),
            jnp.asarray(INF, jnp.int32),
        )
        buf = _merge(empty, rows0, grads0, valid0, lo, logical, fill)
        buf = jax.lax.fori_loop(1, rounds, lambda r, b: _merge(b, *more(r), lo, logical, fill), buf)
        keys1, keys2, grads, cut = buf
        hi = jax.lax.pmin(cut, axis)
        rows = jnp.where(keys1 < hi, keys2, fill)
        # the step was counted by the fast update above: passes reuse its count
        table, st = update(table, state._replace(count=state.count - 1), rows, grads)
        return hi, table, st

    start = jnp.where(rounds > 1, 0, INF).astype(jnp.int32)
    _, table, state = jax.lax.while_loop(lambda c: c[0] < INF, one_pass, (start, table, state))
    return table, state
