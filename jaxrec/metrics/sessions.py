"""Grouping a batch by session (query, user) with fixed shapes, for the session metrics.

A batch of `B` samples carries one integer session id per sample. Sorting by
`(session, score)` puts each session's samples next to each other; segment ids
`0 .. S-1` (`S <= B`, a traced value) then index per-session sums of static size
`B`. Samples of one session need not be contiguous in the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SessionSort(NamedTuple):
    """A batch sorted by `(session id, key)`, every field `[B]` in sorted order.

    Attributes:
      order: the sample (index into the batch) at each sorted position.
      key: the sort key at each position.
      segment: the session's index `0 .. S-1` (sessions in increasing id order).
      session_first: the first sorted position of the sample's session.
      group_first: the first sorted position of its tie group (same session and key).
      group: the tie group's index `0 .. G-1`.
    """

    order: jax.Array
    key: jax.Array
    segment: jax.Array
    session_first: jax.Array
    group_first: jax.Array
    group: jax.Array


def _first_of_run(start: jax.Array) -> jax.Array:
    """For each position, the index of the last `start` at or before it."""
    idx = jnp.arange(start.shape[0], dtype=jnp.int32)
    return jax.lax.cummax(jnp.where(start, idx, 0))


def sort_sessions(session_ids: jax.Array, key: jax.Array, *, descending: bool) -> SessionSort:
    """Sorts a batch by session id, then by `key` (ties keep batch order).

    Args:
      session_ids: `[B]` integer session ids.
      key: `[B]` float sort key within a session.
      descending: sort `key` from high to low within a session.

    Returns:
      A `SessionSort`.
    """
    n = key.shape[0]
    k = -key if descending else key
    sid, k, order = jax.lax.sort(
        (session_ids, k, jnp.arange(n, dtype=jnp.int32)), num_keys=3, is_stable=False
    )
    new_session = jnp.concatenate([jnp.ones((1,), bool), sid[1:] != sid[:-1]])
    new_group = new_session | jnp.concatenate([jnp.ones((1,), bool), k[1:] != k[:-1]])
    return SessionSort(
        order=order,
        key=-k if descending else k,
        segment=jnp.cumsum(new_session, dtype=jnp.int32) - 1,
        session_first=_first_of_run(new_session),
        group_first=_first_of_run(new_group),
        group=jnp.cumsum(new_group, dtype=jnp.int32) - 1,
    )


def segmented_cumsum(x: jax.Array, segment: jax.Array) -> jax.Array:
    """Inclusive cumulative sum of `x` `[B]` restarting at each new `segment`
    (sorted `[B]`), without the cancellation of a global cumsum minus an offset."""
    start = jnp.concatenate([jnp.ones((1,), bool), segment[1:] != segment[:-1]])

    def combine(a, b):
        fa, va = a
        fb, vb = b
        return fa | fb, jnp.where(fb, vb, va + vb)

    return jax.lax.associative_scan(combine, (start, x))[1]


@jax.jit
def rank_within_session(values: jax.Array, session_ids: jax.Array) -> jax.Array:
    """TorchRec's `ranking_within_session`: for each sample, the number of samples
    of its session with a strictly greater value (ties share the best rank).

    Args:
      values: `[B]` floats.
      session_ids: `[B]` integer session ids.

    Returns:
      `[B]` int32 ranks, in batch order.
    """
    s = sort_sessions(session_ids, values, descending=True)
    rank = s.group_first - s.session_first
    return jnp.zeros_like(rank).at[s.order].set(rank, unique_indices=True)


def per_task(fn, num_tasks: int | None, *args: jax.Array, shared: tuple[jax.Array, ...] = ()):
    """`fn(*args, *shared)` on `[B]` arrays, or vmapped over a leading task axis of
    `args` (with `shared` inputs the same for every task)."""
    if num_tasks is None:
        return fn(*args, *shared)
    axes = (0,) * len(args) + (None,) * len(shared)
    return jax.vmap(fn, in_axes=axes)(*args, *shared)
