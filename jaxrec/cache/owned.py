"""Planning across processes: a row shard's slot map lives on one process only, the
one whose devices hold its slots (the shard's owner).

At each ``prepare`` (``RowCache._plan_owned``) the processes exchange three times:

1. each sends every owner its ids of that owner's shards (:func:`route`), with its own
   refusal if it has one;
2. each owner plans its shards on every process's ids of them (:func:`plan_shards`)
   and tells every process whether they fit: a batch that one shard cannot hold is
   refused on every process before any map changes;
3. each owner gives the missed rows slots and sends each process the slots of the ids
   it sent (:func:`slots_of`), which it puts in place (:func:`place`).

So a process keeps the maps of its own shards only and plans only their ids, however
many processes the job has; the batch's ids cross the network once each way, as the
ids of TorchRec's input all-to-all do. The maps end as one process planning every
shard would leave them: a plan does not depend on the order of its ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from ..checkpoint.layout import Buffer
from .ids import CachedTable
from .mover import Lane, columns, lanes
from .slots import Plan, SlotMap


def shard_lanes(weights: Iterable[Buffer], key: str, slots: int) -> Iterator[tuple[Lane, int, int]]:
    """``(lane, first shard, end shard)`` for each device lane holding slots of row
    shards ``[first, end)`` of table ``key`` (``weights``: its weight buffers)."""
    for b in weights:
        where = lanes(b.device_array.sharding, b.array.shape)[0]
        for c in columns(b.blocks, key):
            for r, start, size in zip(c.rows, c.starts, c.sizes, strict=True):
                for x in where:
                    if x.lo < start + size and start < x.hi:
                        yield x, int(r) // slots, -(-int(r + size) // slots)


def shard_owners(weights: Iterable[Buffer], key: str, slots: int, n_shards: int) -> np.ndarray:
    """The process whose devices hold each row shard's slots (a shard on devices of two
    processes was refused before, by ``placement.held_rows``)."""
    owner = np.full(n_shards, -1, np.int64)
    for lane, first, end in shard_lanes(weights, key, slots):
        owner[first:end] = lane.device.process_index
    if (owner < 0).any():
        raise ValueError(
            f"table {key!r}: row shards {np.flatnonzero(owner < 0).tolist()} have "
            "no slots on any device"
        )
    return owner


def route(t: CachedTable, parts: list[np.ndarray], n: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(ids, sent)``: this process's ids of table ``t`` (its parts, concatenated) and,
    per process, the positions in ``ids`` of those whose shard it owns, in order. Ids
    out of range go nowhere (they stay out of range)."""
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    ok = (ids >= 0) & (ids < t.host.config.num_embeddings)
    dest = np.full(len(ids), n, np.int64)
    dest[ok] = t.owners[ids[ok] // t.shard_rows]
    order = np.argsort(dest, kind="stable")
    ends = np.cumsum(np.bincount(dest, minlength=n + 1))
    return ids, np.split(order, ends[:n])[:n]


def _shards(
    t: CachedTable, ids: np.ndarray
) -> Iterator[tuple[int, SlotMap, np.ndarray, np.ndarray]]:
    """``(shard, its maps, shard-local ids)`` for each owned shard that ``ids`` touch."""
    shard = ids // t.shard_rows
    for s, m in enumerate(t.maps):
        if m is not None:
            sel = shard == s
            yield s, m, sel, (ids[sel] - s * t.shard_rows).astype(ids.dtype)


def plan_shards(t: CachedTable, received: list[np.ndarray]) -> tuple[int, list[Plan | None]]:
    """``(ids, a Plan per owned shard, None for the others)`` for every process's ids of
    this process's shards of ``t`` (``received``, in process order)."""
    n_ids = sum(len(r) for r in received)
    by_shard: dict[int, list[np.ndarray]] = {}
    mine = 0
    for r in received:
        for s, _, _, local in _shards(t, r):
            by_shard.setdefault(s, []).append(local)
            mine += len(local)
    if mine != n_ids:  # the processes' routes differ: their meshes or plans do
        raise ValueError(
            f"cached table {t.name!r}: another process sent ids of shards this "
            "one does not own; every process must build the same model and "
            "plan"
        )
    plans: list[Plan | None] = [None] * len(t.maps)
    for s, m in enumerate(t.maps):
        if m is not None:
            plans[s] = m.plan(by_shard.get(s, []), f"cached table {t.name!r} shard {s}")
    return n_ids, plans


def slots_of(t: CachedTable, received: list[np.ndarray]) -> list[np.ndarray]:
    """After the owned shards' assignments: the global slot of each received id, per
    process (their rows counted, LFU)."""
    out = []
    for r in received:
        slots = np.empty(len(r), np.int32)
        for s, m, sel, local in _shards(t, r):
            part = np.empty(len(local), np.int32)
            m.touch(local, part, s * t.slots)
            slots[sel] = part
        out.append(slots)
    return out


def place(
    t: CachedTable,
    ids: np.ndarray,
    sent: list[np.ndarray],
    got: list[np.ndarray],
    outs: list[np.ndarray],
) -> None:
    """The slots each owner sent back (``got``, per process) into ``outs`` (the parts'
    outputs, in order); ids out of range stay out of range (``-1`` / the slot count),
    for the device's bounds check."""
    full = np.where(ids < 0, -1, t.slots * len(t.maps)).astype(np.int32)
    for idx, slots in zip(sent, got, strict=True):
        if len(slots) != len(idx):
            raise ValueError(
                f"cached table {t.name!r}: an owner sent {len(slots)} slots for {len(idx)} ids"
            )
        full[idx] = slots
    at = 0
    for o in outs:
        o[:] = full[at : at + len(o)]
        at += len(o)
