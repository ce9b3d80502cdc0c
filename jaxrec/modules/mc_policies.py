"""Eviction policies and threshold filters of managed collision (TorchRec's ``mc_modules``).

Every ``eviction_interval`` training calls, the ids recorded since the last
eviction are coalesced (unique ids, their counts, their last access step),
optionally filtered by a threshold on the counts, matched against the slot
table (matched slots update their metadata) and the rest compete for slots:

::

    scores  = policy.scores(table metadata) ++ policy.scores(new ids' metadata)
    ranked  = stable argsort(scores, descending)    # ties: table first, then new ids
    head    = ranked[:zch_size]   -> new ids in it get slots
    tail    = ranked[zch_size:]   -> table entries in it are evicted

exactly as TorchRec pairs them (``evicted[i]`` receives ``new[i]``, both in
ranked order). The table's last sorted entry is the reserved miss slot; it
always scores highest. Everything here is static-shape and jit-able; padding
entries carry a score that sorts after every real one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SENTINEL = np.uint32(0xFFFFFFFF)  # empty slot / invalid id key
_INT32_MAX = 2**31 - 1

# (..., counts) -> (kept mask, threshold), as TorchRec's threshold_filtering_func
ThresholdFilter = Callable[..., tuple[jax.Array, jax.typing.ArrayLike]]


def average_threshold_filter(
    id_counts: jax.Array, *, valid: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Keeps ids whose count is strictly greater than the mean count (TorchRec's filter).

    Args:
        id_counts: ``[U]`` counts of the unique ids seen in the interval.
        valid: ``[U]`` bool, False for padding entries (excluded from the mean
            and never kept). ``None``: all entries are real.

    Returns:
        ``([U] bool mask, float32 threshold)``.
    """
    counts = id_counts.astype(jnp.float32)
    valid = jnp.ones(counts.shape, bool) if valid is None else valid
    n = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
    threshold = jnp.sum(jnp.where(valid, counts, 0.0)) / n
    return valid & (counts > threshold), threshold


def dynamic_threshold_filter(
    id_counts: jax.Array,
    threshold_skew_multiplier: float = 10.0,
    *,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Keeps ids whose count exceeds ``total / num_ids * threshold_skew_multiplier``.

    TorchRec's ``dynamic_threshold_filter``; bind the multiplier with
    ``functools.partial(dynamic_threshold_filter, threshold_skew_multiplier=m)``.

    Args:
        id_counts: ``[U]`` counts of the unique ids seen in the interval.
        threshold_skew_multiplier: the threshold in units of the mean count.
        valid: ``[U]`` bool, False for padding entries.

    Returns:
        ``([U] bool mask, float32 threshold)``.
    """
    counts = id_counts.astype(jnp.float32)
    valid = jnp.ones(counts.shape, bool) if valid is None else valid
    n = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
    total = jnp.sum(jnp.where(valid, counts, 0.0))
    threshold = total * (threshold_skew_multiplier / n)
    return valid & (counts > threshold), threshold


class MCHEvictionPolicy:
    """Base of the eviction policies: a score per slot, higher is kept.

    Subclasses are frozen dataclasses (static configuration). Their
    ``threshold_filtering_func(id_counts, *, valid) -> (mask, threshold)``
    (e.g. :func:`average_threshold_filter`) drops infrequent ids of an
    interval before matching and admission, as in TorchRec: a filtered id
    neither enters the table nor updates its slot's metadata.
    """

    threshold_filtering_func: ThresholdFilter | None = None

    def scores(self, counts: jax.Array, last_access: jax.Array, current_iter: jax.Array):
        """``[N]`` scores (higher is kept) from ``[N]`` int32 counts and last access steps."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class LFU_EvictionPolicy(MCHEvictionPolicy):  # noqa: N801 (TorchRec's name)
    """Least frequently used: score = total count since admission (int32)."""

    threshold_filtering_func: ThresholdFilter | None = None

    def scores(self, counts, last_access, current_iter):
        del last_access, current_iter
        return counts


@dataclasses.dataclass(frozen=True)
class LRU_EvictionPolicy(MCHEvictionPolicy):  # noqa: N801
    """Least recently used: score = ``-(current_iter - last_access + 1) ** decay_exponent``."""

    decay_exponent: float = 1.0
    threshold_filtering_func: ThresholdFilter | None = None

    def scores(self, counts, last_access, current_iter):
        del counts
        distance = (current_iter - last_access + 1).astype(jnp.float32)
        return -jnp.power(distance, jnp.float32(self.decay_exponent))


@dataclasses.dataclass(frozen=True)
class DistanceLFU_EvictionPolicy(MCHEvictionPolicy):  # noqa: N801
    """Count discounted by age: ``count / (current_iter - last_access + 1) ** decay_exponent``."""

    decay_exponent: float = 1.0
    threshold_filtering_func: ThresholdFilter | None = None

    def scores(self, counts, last_access, current_iter):
        distance = (current_iter - last_access + 1).astype(jnp.float32)
        return counts.astype(jnp.float32) / jnp.power(distance, jnp.float32(self.decay_exponent))


class SlotTable(NamedTuple):
    """The slot table, sorted by id; entry ``Z - 1`` is the reserved miss slot."""

    sorted_ids: jax.Array  # [Z] uint32, SENTINEL for empty slots
    slots: jax.Array  # [Z] int32 global row of each entry
    counts: jax.Array  # [Z] int32
    last_access: jax.Array  # [Z] int32 training call of the last access


def coalesce_history(ids: jax.Array, iters: jax.Array, length: jax.Array):
    """Unique ids of the history with their counts and last access (static size ``H``).

    Sorts the ids alone (XLA's one-operand sort is several times faster on CPU
    than a sort carrying payloads) and finds each id's run by binary search.

    Returns:
        ``(uniq [H] uint32 ascending then SENTINEL, counts [H] int32 (0 = padding),
        last [H] int32)``.
    """
    h = ids.shape[0]
    live = jnp.arange(h) < length
    ids = jnp.where(live, ids, SENTINEL)
    iters = jnp.where(live, iters, 0)
    ordered = jax.lax.sort(ids)
    first = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
    run = jnp.cumsum(first) - 1  # [H] unique index of each sorted position
    uniq = jnp.full((h,), SENTINEL, jnp.uint32).at[run].set(ordered)
    seg = run[jnp.searchsorted(ordered, ids)]  # unique index of each recorded id
    real = ids != SENTINEL
    counts = jnp.zeros((h,), jnp.int32).at[seg].add(real.astype(jnp.int32))
    last = jnp.zeros((h,), jnp.int32).at[seg].max(jnp.where(real, iters, 0))
    return uniq, counts, last


def sort_table(table: SlotTable) -> SlotTable:
    """The table sorted by id, as a stable sort would (empty slots keep their order).

    Real ids are unique, so each one's place is a binary search into the sorted
    ids; empty slots follow in their current order. Cheaper than a stable
    four-operand sort on CPU.
    """
    ids = table.sorted_ids
    real = ids != SENTINEL
    ordered = jax.lax.sort(ids)
    pos_empty = jnp.sum(real) + jnp.cumsum(~real) - 1
    dest = jnp.where(real, jnp.searchsorted(ordered, ids), pos_empty)
    move = lambda x: jnp.zeros_like(x).at[dest].set(x, unique_indices=True)  # noqa: E731
    return SlotTable(ordered, move(table.slots), move(table.counts), move(table.last_access))


def _compact(mask: jax.Array, values: jax.Array, size: int, fill) -> tuple[jax.Array, jax.Array]:
    """The ``values`` where ``mask``, in order, in ``[size]`` (then ``fill``); and their count."""
    pos = jnp.cumsum(mask) - 1
    idx = jnp.where(mask, pos, size)
    out = jnp.full((size,), fill, values.dtype).at[idx].set(values, mode="drop")
    return out, jnp.sum(mask)


def _sort_keys(scores: jax.Array, valid: jax.Array) -> jax.Array:
    """Ascending sort keys for descending scores; invalid entries sort last."""
    if jnp.issubdtype(scores.dtype, jnp.integer):
        return jnp.where(valid, -scores, _INT32_MAX)
    return jnp.where(valid, -scores, jnp.inf)


def evict_and_admit(
    policy: MCHEvictionPolicy,
    table: SlotTable,
    history: tuple[jax.Array, jax.Array, jax.Array],
    current_iter: jax.Array,
    max_evictions: int,
    fill: int,
) -> tuple[SlotTable, jax.Array]:
    """One eviction: TorchRec's ``_coalesce_history`` + ``_update_and_evict``.

    Args:
        policy: the eviction policy (static).
        table: the current slot table.
        history: ``(ids [H] uint32, iters [H] int32, length int32)`` recorded ids.
        current_iter: int32 scalar, the current training call.
        max_evictions: static cap ``E`` on slots replaced at once. When more new
            ids qualify, the ``E`` best-ranked new ids replace the ``E``
            worst-ranked of the entries that would be evicted.
        fill: value of unused entries of the returned rows.

    Returns:
        ``(new sorted table, [E] int32 rows of the replaced slots, fill-padded)``.
    """
    z = table.sorted_ids.shape[0]
    uniq, counts, last = coalesce_history(*history)
    valid = counts > 0
    if policy.threshold_filtering_func is not None:
        mask, _ = policy.threshold_filtering_func(counts, valid=valid)
        valid = valid & mask
    # frequency order (count descending, id ascending), filtered/padding last
    key = jnp.where(valid, -counts, 1)
    _, order = jax.lax.sort((key, jnp.arange(key.shape[0])), num_keys=1, is_stable=True)
    uniq, counts, last, valid = uniq[order], counts[order], last[order], valid[order]

    pos = jnp.searchsorted(table.sorted_ids[:-1], uniq)
    hit = valid & (table.sorted_ids[pos] == uniq)
    at = jnp.where(hit, pos, z)
    room = (_INT32_MAX - 1 - table.counts[jnp.minimum(pos, z - 1)]).astype(jnp.int32)
    t_counts = table.counts.at[at].add(jnp.minimum(counts, room), mode="drop")
    t_last = table.last_access.at[at].set(last, mode="drop")

    new = valid & ~hit
    h = uniq.shape[0]
    n_ids, _ = _compact(new, uniq, h, SENTINEL)
    n_counts, n_new = _compact(new, counts, h, 0)
    n_last, _ = _compact(new, last, h, 0)
    n_valid = jnp.arange(h) < n_new

    t_keys = _sort_keys(policy.scores(t_counts, t_last, current_iter), jnp.ones((z,), bool))
    n_keys = _sort_keys(policy.scores(n_counts, n_last, current_iter), n_valid)
    lowest = jnp.iinfo(jnp.int32).min if jnp.issubdtype(t_keys.dtype, jnp.integer) else -jnp.inf
    t_keys = t_keys.at[z - 1].set(lowest)  # the miss slot always stays
    # The ranking is a stable sort of table ++ new ids (table first on ties). Rather than
    # sorting Z + H entries, sort each side and place every entry by binary search.
    t_sorted, t_order = jax.lax.sort((t_keys, jnp.arange(z)), num_keys=1, is_stable=True)
    n_keys = n_keys.astype(t_keys.dtype)
    n_sorted, n_order = jax.lax.sort((n_keys, jnp.arange(h)), num_keys=1, is_stable=True)
    n_place = jnp.arange(h) + jnp.searchsorted(t_sorted, n_sorted, side="right")
    # new ids ranked in the top Z: a prefix of n_order; the table entries they push out
    # of it: the same number at the end of t_order (both in ranked order, TorchRec's pairs)
    n_pairs = jnp.sum(n_place < z)

    e = max_evictions
    i = jnp.arange(e)
    take = i < jnp.minimum(n_pairs, e)
    shift = jnp.maximum(n_pairs - e, 0)  # capped: evict the worst-ranked ones
    ev = jnp.where(take, t_order[jnp.clip(z - n_pairs + i + shift, 0, z - 1)], z)
    src = jnp.where(take, n_order[jnp.minimum(i, h - 1)], 0)
    rows = jnp.where(take, table.slots[jnp.minimum(ev, z - 1)], fill)

    sorted_ids = table.sorted_ids.at[ev].set(n_ids[src], mode="drop")
    t_counts = t_counts.at[ev].set(n_counts[src], mode="drop")
    t_last = t_last.at[ev].set(n_last[src], mode="drop")
    new_table = sort_table(SlotTable(sorted_ids, table.slots, t_counts, t_last))
    return new_table, rows.astype(jnp.int32)
