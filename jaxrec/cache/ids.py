"""A batch's ids of cached tables: found in its KJTs, planned, rewritten as slots."""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import NamedTuple, TypeGuard

import jax
import numpy as np

from ..sparse import KeyedJaggedTensor
from .host import HostTable
from .slots import Plan, SlotMap


class CachedTable(NamedTuple):
    """A cached table: its host rows, the features it reads, its row shards' slot maps."""

    name: str
    key: str  # checkpoint key
    host: HostTable
    features: tuple[str, ...]
    shard_rows: int  # logical rows per row shard (ceil blocks; the last may be smaller)
    slots: int  # slots per row shard
    maps: list[SlotMap | None]  # None: a shard of another process (see owned.py)
    owners: np.ndarray  # the process of each row shard


def all_maps(t: CachedTable) -> list[SlotMap]:
    """Every row shard's slot map of ``t``: one process holds them all (several
    processes plan their own shards' only, see ``owned.py``)."""
    maps = [m for m in t.maps if m is not None]
    if len(maps) != len(t.maps):
        raise ValueError(
            f"cached table {t.name!r}: another process holds some of its slot "
            "maps (plan it with owned.plan_shards)"
        )
    return maps


def plan_table(
    t: CachedTable, parts: list[np.ndarray], outs: list[np.ndarray] | None
) -> tuple[int, list[Plan]]:
    """``(ids in range, a Plan per row shard)`` for a table's ids (``parts``); every
    shard is checked before any changes. ``outs``: where :func:`touch` will write the
    parts' slots (one shard, every id in range: the plan's pass starts them)."""
    rows, maps = t.host.config.num_embeddings, all_maps(t)
    if not all(in_range(p, rows) for p in parts):
        parts, outs = [p[(p >= 0) & (p < rows)] for p in parts], None
    n_ids = sum(len(p) for p in parts)
    if len(maps) == 1:
        return n_ids, [maps[0].plan(parts, f"cached table {t.name!r}", outs)]
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    shard = ids // t.shard_rows
    return n_ids, [
        m.plan(
            [(ids[shard == s] - s * t.shard_rows).astype(ids.dtype)],
            f"cached table {t.name!r} shard {s}",
        )
        for s, m in enumerate(maps)
    ]


def touch(t: CachedTable, ids: np.ndarray, out: np.ndarray, scanned: bool) -> None:
    """``out[:]``: the global slots of ``ids`` (assigned); ids out of range stay out of
    range (``-1`` / the slot count), for the device's bounds check. ``scanned``: the
    plan's pass wrote the hits' slots already."""
    maps = all_maps(t)
    if scanned:
        maps[0].finish(ids, out)
        return
    rows = t.host.config.num_embeddings
    if len(maps) == 1 and in_range(ids, rows):
        maps[0].touch(ids, out, 0)  # the common case, one pass
        return
    ok = (ids >= 0) & (ids < rows)
    out[:] = np.where(ids < 0, -1, t.slots * len(t.maps))
    good = ids[ok]
    shard = good // t.shard_rows
    slots = np.empty(len(good), out.dtype)
    for s, m in enumerate(maps):
        sel = shard == s
        part = np.empty(int(sel.sum()), out.dtype)
        m.touch((good[sel] - s * t.shard_rows).astype(ids.dtype), part, s * t.slots)
        slots[sel] = part
    out[ok] = slots


def with_values(kjt: KeyedJaggedTensor, values: jax.Array | np.ndarray) -> KeyedJaggedTensor:
    children, aux = kjt.tree_flatten()
    return KeyedJaggedTensor.tree_unflatten(aux, (values, *children[1:]))


def in_range(ids: np.ndarray, rows: int) -> bool:
    return not len(ids) or (int(ids.min()) >= 0 and int(ids.max()) < rows)


def is_kjt(x: object) -> TypeGuard[KeyedJaggedTensor]:
    return isinstance(x, KeyedJaggedTensor)


class FeatureSpan(NamedTuple):
    """A feature's ids in a KJT's ``values``: ``[lo, hi)``, in its static slice
    ``[lo, lo + capacity)``."""

    feature: str
    lo: int
    hi: int
    capacity: int


def feature_spans(kjt: KeyedJaggedTensor, features: Container[str]) -> Iterator[FeatureSpan]:
    """A :class:`FeatureSpan` for each cached feature of ``kjt``.

    A per-device KJT stacked by ``shard_batch`` has a leading device axis: not here
    (``prepare`` takes host batches, before stacking)."""
    lengths = np.asarray(kjt.lengths()).reshape(len(kjt.keys()), -1)
    starts = kjt.capacity_offsets()
    for k, f in enumerate(kjt.keys()):
        if f in features:
            yield FeatureSpan(
                f, starts[k], starts[k] + int(lengths[k].sum()), starts[k + 1] - starts[k]
            )
