"""A ``RowCache``'s slot maps on the device, and the one program that plans a batch.

Each cached table's slot map is a :class:`~jaxrec.cache.sets.SlotState` on the
device. A batch's KJT values go to the device once; one jitted program plans
every cached table (:func:`~jaxrec.cache.sets.plan`: C++ on the CPU, XLA
elsewhere), rewrites the ids as
slots in the values (still on the device) and packs each table's moves. The host
then reads only the moves (a few numbers per missed row) and the counts: it does
no work per id. A batch that does not fit in some table's cache changes no table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..distributed.types import CacheAlgorithm
from ..sparse import bucket_capacity
from .ids import CachedTable
from .sets import SetLayout, SlotState, empty_state, plan_many, set_layout
from .slots import CacheTooSmallError, Move

if TYPE_CHECKING:  # jax exports the class as a variable (jax.Device), not a type
    from jaxlib._jax import Device


class TableCounts(NamedTuple):
    """What one table's plan of a batch did (for ``CacheStats``)."""

    ids: int  # ids in range
    rows: int  # distinct rows
    fills: int
    evictions: int


class DevicePlan(NamedTuple):
    """A planned batch: its KJTs' values with the cached tables' ids as slots (device
    arrays, ``None`` for a KJT without cached features), each table's moves by
    checkpoint key and counts by table name."""

    values: list[jax.Array | None]
    moves: dict[str, Move]
    counts: dict[str, TableCounts]


class _Route(NamedTuple):
    """Static: where a table's ids are in a batch (hashable, a program's key)."""

    name: str
    layout: SetLayout
    slices: tuple[tuple[int, int, int], ...]  # (KJT, start, capacity) of each feature


class DeviceSlotMaps:
    """The device slot maps of ``tables`` (every row shard of each: one process),
    with ``algorithms`` by table name, on ``device`` (default: JAX's first)."""

    def __init__(
        self,
        tables: Mapping[str, CachedTable],
        algorithms: Mapping[str, CacheAlgorithm],
        device: Device | None = None,
    ):
        self.tables = dict(tables)
        self.device = device or jax.devices()[0]
        self.layouts = {
            name: set_layout(t.host.config.num_embeddings, len(t.maps), t.slots, algorithms[name])
            for name, t in self.tables.items()
        }
        self.states = {n: self._empty(lay) for n, lay in self.layouts.items()}
        # (routes, KJTs used) -> the jitted _plan_batch
        self._programs: dict[tuple[tuple[_Route, ...], tuple[int, ...]], Callable[..., Any]] = {}

    def _empty(self, layout: SetLayout) -> SlotState:
        return jax.device_put(empty_state(layout), self.device)

    def plan(
        self,
        values: Sequence[jax.Array | np.ndarray],
        spans: Mapping[str, list[tuple[int, int, int, int]]],
    ) -> DevicePlan:
        """Plans a batch: ``values`` of each KJT (host or device arrays), ``spans[name]``
        the ``(kjt, lo, hi, capacity)`` of each cached table's features (ids ``[lo, hi)``
        in the static slice ``[lo, lo + capacity)``). Raises ``CacheTooSmallError`` (no
        slot map changed) when a table's rows do not fit in its cache's sets."""
        routes = tuple(
            _Route(n, self.layouts[n], tuple((i, lo, c) for i, lo, _, c in spans[n]))
            for n in self.tables
            if spans[n]
        )
        used = sorted({i for r in routes for i, _, _ in r.slices})
        none = np.zeros(0, np.int64)
        counts = {n: TableCounts(0, 0, 0, 0) for n in self.tables}
        moves = {t.key: Move(none, none, none, none) for t in self.tables.values()}
        if not routes:
            return DevicePlan([None] * len(values), moves, counts)
        lengths = np.array([hi - lo for r in routes for _, lo, hi, _ in spans[r.name]], np.int32)
        program = self._programs.get((routes, tuple(used)))
        if program is None:
            program = jax.jit(functools.partial(_plan_batch, routes, tuple(used)), donate_argnums=0)
            self._programs[(routes, tuple(used))] = program
        states = tuple(self.states[r.name] for r in routes)
        new_states, new_values, summary, packed = program(
            states, tuple(_int32(values[i]) for i in used), lengths
        )
        for r, s in zip(routes, new_states, strict=True):  # the same state when refused
            self.states[r.name] = s
        summary = np.asarray(summary)  # [tables, 5]: the step's one wait for the device
        for r, row in zip(routes, summary, strict=True):
            if row[4]:
                lay = r.layout
                raise CacheTooSmallError(
                    f"cached table {r.name!r}: the batch's distinct rows need more than the "
                    f"{lay.ways} slots of one of its cache's {lay.sets} sets per shard "
                    f"({lay.slots} slots per shard, {row[1]} distinct rows in the batch); "
                    "raise CacheParams.load_factor (each set then gets more of a batch's "
                    "rows' worth of slots) or use smaller batches"
                )
        for r, row, p in zip(routes, summary, packed, strict=True):
            n_fill, n_evict = int(row[2]), int(row[3])
            counts[r.name] = TableCounts(int(row[0]), int(row[1]), n_fill, n_evict)
            got = _prefix(p, max(n_fill, n_evict)).astype(np.int64)
            # by row: the host table is then read and written in address order (on the
            # CPU, 26k rows a step of 1M-row tables moved ~10 ms faster than in set order)
            fr, fs = _by_row(got[1, :n_fill], got[0, :n_fill])
            er, es = _by_row(got[3, :n_evict], got[2, :n_evict])
            moves[self.tables[r.name].key] = Move(fs, fr, es, er)
        out: list[jax.Array | None] = [None] * len(values)
        for i, v in zip(used, new_values, strict=True):
            out[i] = v
        return DevicePlan(out, moves, counts)

    def cached(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, logical rows)`` of every occupied slot of table ``name``."""
        lay = self.layouts[name]
        held = np.asarray(self.states[name].rows)
        slots = np.flatnonzero(held >= 0)
        return slots, held[slots].astype(np.int64) + (slots // lay.slots) * lay.shard_rows

    def clear(self) -> None:
        """Empties every cache; LFU counts stay (as FBGEMM's ``lfu_state``)."""
        for name, lay in self.layouts.items():
            counts = self.states[name].counts
            self.states[name] = self._empty(lay)._replace(counts=counts)


def _prefix(packed: jax.Array, n: int) -> np.ndarray:
    """The first ``n`` columns of a table's packed moves on the host. Off the CPU only a
    padded prefix crosses (a few programs: ``bucket_capacity`` sizes), not the ``[4, N]``
    of every id (2.6 MB a table at 164k ids)."""
    if _on_cpu(packed):
        return np.asarray(packed)[:, :n]
    k = min(packed.shape[1], bucket_capacity(max(n, 1), minimum=256))
    return np.asarray(_slice(packed, k))[:, :n]


def _int32(values: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
    """KJT values as the int32 a device program takes. 64-bit host ids beyond int32 stay
    out of range (below 0: -1, above: int32's top, past any cached table's rows)
    rather than wrap into range (a pass over them on the host: int32 ids need none)."""
    if isinstance(values, np.ndarray) and values.dtype.itemsize == 8 and len(values):
        info = np.iinfo(np.int32)
        return np.clip(values, -1, info.max).astype(np.int32)
    return values


def _by_row(rows: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, slots)`` in row order (rows and slots are int32: one int64 key sorts
    both, a few times faster than an argsort and two gathers)."""
    key = np.sort((rows << 32) | slots)
    return key >> 32, key & 0xFFFFFFFF


def _on_cpu(x: jax.Array) -> bool:
    return all(d.platform == "cpu" for d in x.devices())


@functools.partial(jax.jit, static_argnums=1)
def _slice(packed: jax.Array, k: int) -> jax.Array:
    return packed[:, :k]


def _plan_batch(routes: tuple[_Route, ...], used: tuple[int, ...], states, values, lengths):
    """The program: every table's plan on its features' static slices; all of them
    kept, or none (one refused)."""
    at = {k: j for j, k in enumerate(used)}
    new_values = [jnp.asarray(v) for v in values]
    raw = [v.astype(jnp.int32) for v in new_values]
    layouts, ids, masks = [], [], []
    span = 0
    for r in routes:
        parts, valid = [], []
        for k, lo, cap in r.slices:
            parts.append(jax.lax.slice(raw[at[k]], (lo,), (lo + cap,)))
            valid.append(jnp.arange(cap, dtype=jnp.int32) < lengths[span])
            span += 1
        layouts.append(r.layout)
        ids.append(jnp.concatenate(parts))
        masks.append(jnp.concatenate(valid))
    # all tables kept, or none (one refused)
    plans = plan_many(layouts, states, ids, masks)
    for r, planned in zip(routes, plans, strict=True):
        off = 0
        for k, lo, cap in r.slices:
            v = new_values[at[k]]
            got = planned.slots[off : off + cap].astype(v.dtype)  # padding: unchanged
            new_values[at[k]] = jax.lax.dynamic_update_slice(v, got, (lo,))
            off += cap
    summary = jnp.stack(
        [
            jnp.stack([p.n_ids, p.n_rows, p.n_fill, p.n_evict, p.overflow.astype(jnp.int32)])
            for p in plans
        ]
    )
    packed = tuple(
        jnp.stack([p.fill_slots, p.fill_rows, p.evict_slots, p.evict_rows]) for p in plans
    )
    return tuple(p.state for p in plans), tuple(new_values), summary, packed
