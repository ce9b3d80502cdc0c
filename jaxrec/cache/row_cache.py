"""RowCache: tables in host memory, their hot rows in a device cache (FBGEMM's UVM caching).

The model is built with each cached table as a table of *slots* (see
``cached_configs``); the table itself and its optimizer rows live on the host
(:class:`~jaxrec.cache.HostTable`). Before a batch runs, :meth:`RowCache.prepare`
finds each cached table's rows in the batch, gives the missed ones slots (evicting
LRU / LFU rows the batch does not use) and rewrites the batch's ids as slots: with
one process in one program on the device over set-associative slot maps
(``device_maps.py``, ``sets.py``), with several on the host (``slots.py``).
:meth:`RowCache.load` then writes the evicted rows back to the host and the missed
rows into their slots, in place on the state's buffers. The train step
runs unchanged on slots, so every step updates exactly the rows and optimizer
state an all-device-memory step would.

Prepared batches are applied in the order they were prepared, which is what lets
the train pipeline prepare batch ``i + 1`` while step ``i`` runs (a row evicted by
one load is back on the host before a later load reads it). The cache keeps each
prepared batch's moves until it is loaded: :meth:`RowCache.flush` copies what the
device holds meanwhile, and :meth:`RowCache.discard_prefetched` loads the batches a
stopped pipeline dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np
from flax import nnx

from ..checkpoint.delta import ModelDeltaTracker, Published, Restored
from ..checkpoint.delta_rows import marked
from ..checkpoint.layout import HostRows, replace_tables, table_buffers
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.paths import components
from ..distributed.types import CacheParams
from ..embedding.optimizer import CombinedOptimizer
from ..train.step import TrainState
from . import exchange, owned
from .changes import ChangedRows, changed_rows
from .device_maps import DeviceSlotMaps
from .errors import hand_back
from .host import HostTable, check_host
from .ids import CachedTable, feature_spans, is_kjt, plan_table, touch, with_values
from .inflight import InFlight
from .mover import InPlace, MovePaths, Mover, Staged
from .placement import find_tables, held_rows, slot_shards
from .slots import CacheTooSmallError, Move, Plan, SlotMap
from .unloaded import device_rows

KeyT = TypeVar("KeyT")
OutT = TypeVar("OutT")


@dataclasses.dataclass
class CacheStats:
    """Counts since the start (or :meth:`RowCache.reset_stats`), per table.

    ``ids``: looked-up ids in range; ``rows``: distinct rows per batch, summed;
    ``misses``: rows copied from the host; ``evictions``: rows copied back;
    ``late``: missed rows copied at load time rather than when prepared (an earlier
    batch still in flight evicts them).
    """

    ids: int = 0
    rows: int = 0
    misses: int = 0
    evictions: int = 0
    late: int = 0

    @property
    def hit_rate(self) -> float:
        """Ids served from the cache (a missed row's first id is the miss)."""
        return 1.0 - self.misses / self.ids if self.ids else float("nan")

    @property
    def row_hit_rate(self) -> float:
        """Distinct rows of a batch found in the cache."""
        return 1.0 - self.misses / self.rows if self.rows else float("nan")


class Prepared(NamedTuple):
    """A batch with cached tables' ids rewritten as slots, and its staged move (the
    missed rows already gathered from the host, or an in-place move's positions;
    ``None``: nothing moves)."""

    batch: Any
    staged: Staged | InPlace | None
    serial: int


class RowCache:
    """The host tier and device caches of a model's ``fused_uvm_caching`` tables.

    Args:
        graphdef, optimizer, state: from ``init_train_state`` of the model built
            with :func:`cached_configs` (each cached table has slots, not rows).
        host_tables: ``{table name: HostTable}`` with the logical tables
            (``num_embeddings`` rows) and their optimizer rows.
        params: ``CacheParams`` per table name, or one for all (its algorithm is
            used; the slot counts are the device tables').
        threads: tables planned at once by :meth:`prepare` (their C++ passes release
            the GIL); default: one per table, up to the machine's cores.
        slot_maps: where each table's slot map lives and a batch is planned.
            ``"device"`` (the default with one process on GPUs): a set-associative map
            of 32-way sets on the device (``jaxrec.cache.sets``, as FBGEMM's), planned
            by one program per batch; the host reads back only the moves. ``"host"``
            (the default on a CPU, where it is faster, and the only choice with several
            processes): fully associative maps on the host (``SlotMap``), planned by
            C++ passes over every id.
        move_paths: the move paths allowed (:class:`MovePaths`; default: each where it
            applies: in place on a CPU, staged in pinned host memory off it).

    A model-parallel state is supported for any sharding type but data parallel;
    row shards keep their own caches. With several processes, each holds the host rows
    and the slot maps of its own devices' shards (:func:`host_rows`), and plans and
    moves only those: at each ``prepare`` the processes send each shard's owner their
    ids of it and get their slots back (``owned.py``). So each process must build its
    ``RowCache`` objects in the same order and prepare the same batches, each passing
    its own devices' part. ``timeout_s``: how long a ``prepare`` waits for the other
    processes.

    Example:
        >>> cache = RowCache(graphdef, optimizer, state, {"t": host}, CacheParams())
        >>> step = CachedTrainStep(make_train_step(graphdef, optimizer, loss_fn), cache)
        >>> state, loss, _ = step(state, batch)
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        optimizer: CombinedOptimizer,
        state: TrainState,
        host_tables: Mapping[str, HostTable],
        params: CacheParams | Mapping[str, CacheParams],
        *,
        threads: int | None = None,
        timeout_s: float = 600.0,
        slot_maps: str | None = None,
        move_paths: MovePaths | None = None,
    ):
        self.graphdef, self.optimizer = graphdef, optimizer
        layout = table_buffers(graphdef, optimizer, state)
        self.tables: dict[str, CachedTable] = {}
        found, readers = find_tables(graphdef, state, host_tables)
        weights = [b for b in layout.buffers if b.field == "weight"]
        on_host = _on_host(
            slot_maps, {d.platform for b in weights for d in b.device_array.sharding.device_set}
        )
        algorithms = {}
        for name, host in host_tables.items():
            key, device = found[name]
            p = params if isinstance(params, CacheParams) else params[name]
            n_shards, slots = slot_shards(weights, key, device)
            if device.num_embeddings > np.iinfo(np.int32).max:  # slots are int32 ids
                raise ValueError(
                    f"table {name!r}: {device.num_embeddings} cache slots in all exceed the "
                    "int32 ids a batch carries; lower CacheParams.load_factor or shard it"
                )
            if slots * n_shards != device.num_embeddings or host.config.name != name:
                raise ValueError(
                    f"table {name!r}: the device table has {device.num_embeddings} slots in "
                    f"{n_shards} row shards; build it with cached_configs"
                )
            check_host(name, host, device, optimizer, readers)
            rows = host.config.num_embeddings
            shard_rows = -(-rows // n_shards)
            held = held_rows(weights, key, slots, shard_rows, rows)
            if host.rows != held:
                raise ValueError(
                    f"host table {name!r} holds rows {list(host.rows)}, and this process's "
                    f"devices cache rows {list(held)}: build it with rows=host_rows(...)"
                )
            owners = owned.shard_owners(weights, key, slots, n_shards)
            maps = [  # this process's shards only (on the host)
                SlotMap(max(0, min(shard_rows, rows - s * shard_rows)), slots, p.algorithm)
                if owners[s] == jax.process_index() and on_host
                else None
                for s in range(n_shards)
            ]
            algorithms[name] = p.algorithm
            feats = tuple(host.config.feature_names) or (name,)
            self.tables[name] = CachedTable(name, key, host, feats, shard_rows, slots, maps, owners)
        self._maps = None if on_host else DeviceSlotMaps(self.tables, algorithms)
        self._feature_table = {f: t for t in self.tables.values() for f in t.features}
        self._host = {t.key: t.host.fields for t in self.tables.values()}
        names = {t.key: t.name for t in self.tables.values()}
        offsets = {t.key: t.host.rows[0] for t in self.tables.values()}
        self._mover = Mover(layout.buffers, self._host, names, offsets, move_paths or MovePaths())
        self._tag = f"jaxrec-cache-{next(_CACHES)}"  # the same on every process (same order)
        self._peers: exchange.Peers | None = None
        self._closed = False
        self._timeout_s = timeout_s
        # what each host field must stay (moves address it): filled in place, not replaced
        self._host_shapes = {
            (t.name, t.key, f): (a.shape, a.dtype)
            for t in self.tables.values()
            for f, a in t.host.fields.items()
        }
        self._held: Prepared | None = None  # a batch whose load failed before it moved rows
        # evictions not back on the host yet (in place, moves read the host in order)
        self._inflight = InFlight(self.tables.values(), counting=not self._mover.inplace)
        self._threads = max(1, min(len(self.tables), threads or os.cpu_count() or 1))
        self._prepared = 0  # serial numbers: loads must follow prepares in order
        self._loaded = 0
        # each prepared batch not loaded yet: serial -> (its moves, its staged move)
        self._unloaded: dict[int, tuple[dict[str, Move], Staged | InPlace | None]] = {}
        self._lock = threading.Lock()  # prepare() may run in a pipeline's thread
        self._changes: ChangedRows | None = None  # rows written back since the last delta link
        self.stats = {name: CacheStats() for name in self.tables}

    # ----- host: plan a batch -----
    def prepare(self, batch: Any) -> Prepared:
        """Plans ``batch`` (a pytree with host ``KeyedJaggedTensor`` leaves, e.g. a
        ``Batch`` or a list of per-device batches): slots for the cached tables' rows,
        ids rewritten as slots. Raises ``CacheTooSmallError`` (nothing changed) when a
        shard's cache cannot hold the batch's rows."""
        with self._lock, _annotate("prepare"):
            originals = [x for x in jax.tree.leaves(batch, is_leaf=is_kjt) if is_kjt(x)]
            kjts = [k.narrow_ids() for k in originals]  # id words -> int32, wide ids out of range
            # (kjt, lo, hi, capacity) of each table's ids
            spans: dict[str, list[tuple[int, int, int, int]]] = {name: [] for name in self.tables}
            for i, kjt in enumerate(kjts):
                for f, lo, hi, cap in feature_spans(kjt, self._feature_table):
                    spans[self._feature_table[f].name].append((i, lo, hi, cap))
            error: ValueError | None = None
            try:  # before anything changes
                self._check_host()
                self._inflight.check_room()
            except ValueError as e:
                error = e
            if error is not None and self._maps is not None:
                raise error
            new: Sequence[jax.Array | np.ndarray]  # each KJT's values, the ids as slots
            if self._maps is not None:  # on the device: the values stay there, as slots
                planned = self._maps.plan([k.values() for k in kjts], spans)
                new = [
                    k.values() if v is None else v
                    for k, v in zip(kjts, planned.values, strict=True)
                ]
                moves = planned.moves
                for name, c in planned.counts.items():
                    st = self.stats[name]
                    st.ids, st.rows = st.ids + c.ids, st.rows + c.rows
                    st.misses, st.evictions = st.misses + c.fills, st.evictions + c.evictions
            else:
                values = [np.asarray(k.values()) for k in kjts]
                new = slots = [v.copy() for v in values]  # the ids as slots
                # each table's id parts, and where their slots go: every process's, in order
                parts = {n: [values[i][lo:hi] for i, lo, hi, _ in s] for n, s in spans.items()}
                outs = {n: [slots[i][lo:hi] for i, lo, hi, _ in s] for n, s in spans.items()}
                if jax.process_count() > 1:  # every process refuses the batch, or none
                    moves = self._plan_owned(parts, outs, error)
                elif error is not None:
                    raise error
                else:
                    moves = self._plan_here(parts, outs)
            self._prepared += 1
            if self._mover.inplace:  # moves read the host in program order: never late
                staged = self._mover.stage(moves, self._host)
            else:
                staged = self._mover.stage(moves, self._host, self._late(moves))
                self._inflight.add(self._prepared, moves)
            self._unloaded[self._prepared] = (moves, staged)
            by_id = {id(o): with_values(k, v) for o, k, v in zip(originals, kjts, new, strict=True)}
            out = jax.tree.map(lambda x: by_id[id(x)] if is_kjt(x) else x, batch, is_leaf=is_kjt)
            return Prepared(out, staged, self._prepared)

    def _threads_for(self, ids: int) -> int:
        return self._threads if ids >= _THREAD_IDS * len(self.tables) else 1

    def _plan_here(
        self, parts: Mapping[str, list[np.ndarray]], outs: Mapping[str, list[np.ndarray]]
    ) -> dict[str, Move]:
        """One process: plans every table's shards on the batch's ids, rewrites them."""

        # reads the maps' scratch marks only: every shard checked first
        def plan(name: str) -> tuple[int, list[Plan]]:
            return plan_table(self.tables[name], parts[name], outs[name])

        threads = self._threads_for(sum(len(p) for ps in parts.values() for p in ps))
        plans = dict(zip(self.tables, self._each(plan, threads, self.tables), strict=True))

        def commit(name: str) -> tuple[str, Move]:
            t = self.tables[name]
            move = self._commit(t, *plans[name])
            scanned = plans[name][1][0].scanned
            for ids, out in zip(parts[name], outs[name], strict=True):
                touch(t, ids, out, scanned)
            return t.key, move

        return dict(self._each(commit, threads, self.tables))

    def _plan_owned(
        self,
        parts: Mapping[str, list[np.ndarray]],
        outs: Mapping[str, list[np.ndarray]],
        error: ValueError | None,
    ) -> dict[str, Move]:
        """Several processes: each plans the shards it owns on every process's ids of
        them, in three exchanges (see ``owned.py``); a batch any process refuses is
        refused on all of them before any map changes."""
        if self._closed:
            raise RuntimeError("this RowCache was closed: make a new one on every process")
        if self._peers is None:  # connected at the first batch, by every process
            self._peers = exchange.Peers(self._tag, self._timeout_s)
        n, what = jax.process_count(), f"batch {self._prepared + 1}"
        routes = {name: owned.route(t, parts[name], n) for name, t in self.tables.items()}
        sends = [
            pickle.dumps(
                {
                    "error": None if error is None else str(error),
                    "ids": [ids[sent[q]] for ids, sent in routes.values()],
                },
                5,
            )
            for q in range(n)
        ]
        got = [pickle.loads(b) for b in self._peers.exchange(sends, f"{what}'s ids")]
        if error is not None:
            raise error
        for q, g in enumerate(got):
            if g["error"] is not None:
                raise ValueError(f"process {q} refused this batch: {g['error']}")
        received = {name: [g["ids"][i] for g in got] for i, name in enumerate(self.tables)}
        threads = self._threads_for(sum(len(r) for rs in received.values() for r in rs))
        plans: list[tuple[int, list[Plan | None]]] = []
        refusal: Exception | None = None
        try:  # the plans change scratch marks only
            plans = self._each(
                lambda name: owned.plan_shards(self.tables[name], received[name]),
                threads,
                self.tables,
            )
        except Exception as e:  # noqa: BLE001 (sent to every process, then raised here)
            refusal = e
        mine = None if refusal is None else (isinstance(refusal, CacheTooSmallError), str(refusal))
        said = self._peers.allgather(pickle.dumps(mine), f"{what}'s plans")
        if refusal is not None:
            raise refusal
        for q, r in enumerate(pickle.loads(b) for b in said):
            if r is not None:  # the same type here: callers may catch a too-small cache
                kind = CacheTooSmallError if r[0] else ValueError
                raise kind(f"process {q} refused this batch: {r[1]}")

        def commit(i: int) -> tuple[str, Move, list[np.ndarray]]:
            t = self.tables[list(self.tables)[i]]
            return t.key, self._commit(t, *plans[i]), owned.slots_of(t, received[t.name])

        done: list[tuple[str, Move, list[np.ndarray]]] = []
        failure: Exception | None = None
        try:
            done = self._each(commit, threads, range(len(self.tables)))
        except Exception as e:  # noqa: BLE001 (sent to every process, then raised here)
            failure = e
        back = [
            pickle.dumps(str(failure) if failure else [x[2][q] for x in done], 5) for q in range(n)
        ]
        got = [pickle.loads(b) for b in self._peers.exchange(back, f"{what}'s slots")]
        if failure is not None:
            raise failure
        for q, g in enumerate(got):
            if isinstance(g, str):
                raise RuntimeError(
                    f"process {q} failed while assigning slots to {what} ({g}): the processes' "
                    "caches are no longer in step; restart the job from a checkpoint"
                )
        for i, (name, t) in enumerate(self.tables.items()):
            ids, sent = routes[name]
            owned.place(t, ids, sent, [g[i] for g in got], outs[name])
        return {key: move for key, move, _ in done}

    def _each(self, fn: Callable[[KeyT], OutT], threads: int, keys: Iterable[KeyT]) -> list[OutT]:
        """``fn(key)`` for each of ``keys`` (the cached tables' names, say), in order; on
        ``threads`` threads when more than one (the C++ passes release the GIL). Every
        call ends before the first error (in key order) is raised."""
        keys = list(keys)
        if threads == 1:
            return [fn(k) for k in keys]
        futures = [_pool(threads).submit(fn, k) for k in keys]
        wait(futures)
        return [f.result() for f in futures]

    def _late(self, moves: dict[str, Move]) -> dict[str, np.ndarray] | None:
        """Per table, which fill rows an earlier prepared batch evicts and whose value is
        not back on the host yet (they are copied at load time)."""
        out = self._inflight.late(moves)
        if out is None:
            return None
        for name, t in self.tables.items():
            self.stats[name].late += int(out[t.key].sum())
        return out

    def _commit(self, t: CachedTable, n_ids: int, plans: Sequence[Plan | None]) -> Move:
        st = self.stats[t.name]
        st.ids += n_ids
        none = np.zeros(0, np.int64)
        fills, evicts = [(none, none)], [(none, none)]  # (a process may own no shard of t)
        for s, (m, plan) in enumerate(zip(t.maps, plans, strict=True)):
            if m is None or plan is None:  # another process's shard
                continue
            a = m.assign(plan)
            base_slot, base_row = s * t.slots, s * t.shard_rows
            fills.append((a.fill_slots + base_slot, a.fill_rows + base_row))
            evicts.append((a.evict_slots + base_slot, a.evict_rows + base_row))
            st.rows += a.hits + len(a.fill_rows)
            st.misses += len(a.fill_rows)
            st.evictions += len(a.evict_rows)
        fs, fr = (np.concatenate(x) for x in zip(*fills, strict=True))
        es, er = (np.concatenate(x) for x in zip(*evicts, strict=True))
        return Move(fs, fr, es, er)

    # ----- device: apply a prepared batch -----
    def load(self, state: TrainState, prepared: Prepared) -> TrainState:
        """``state`` with the prepared batch's missed rows in their slots (the evicted
        rows go back to host memory: the previous load's are written back first).

        A load refused before it moves anything (a host field replaced since) changes
        nothing: fix the cause and load the same batch again, or go on with the next
        one, whose load then loads the refused batch's rows first (they are the cache's
        now; that batch itself is simply not trained on)."""
        with _annotate("load"):
            held = self._held
            if held is not None and prepared.serial > held.serial:
                state = self._load(state, held)
            return self._load(state, prepared)

    def _load(self, state: TrainState, prepared: Prepared) -> TrainState:
        if prepared.serial <= self._loaded:
            raise ValueError(
                f"prepared batch {prepared.serial} was loaded already (its step ran, or "
                "discard_prefetched loaded it without one; later loads may reuse its "
                "slots): prepare the batch again"
            )
        if prepared.serial != self._loaded + 1:
            raise ValueError(
                f"prepared batches must be loaded in the order they were prepared: this is "
                f"number {prepared.serial}, the next to load is {self._loaded + 1} (a "
                "pipeline stopped with batches prefetched? state = "
                "cache.discard_prefetched(state) loads their rows without training on them)"
            )
        try:
            self._check_host()
            self.write_back()
            if prepared.staged is not None:
                state = self._apply(state, prepared.staged, prepared.serial)
        except Exception:
            self._held = prepared  # nothing moved: loaded again before any later batch
            raise
        self._held = None
        self._loaded += 1
        moves = self._unloaded.pop(prepared.serial, (None, None))[0]
        if self._changes is not None and moves:  # evicted: changed since the link, maybe
            self._changes.written_back(moves)
        if prepared.staged is None:
            self._inflight.release(prepared.serial)
        return state

    def _check_host(self) -> None:
        """Every host field as the cache found it (the moves address its rows)."""
        for (name, key, field), (shape, dtype) in self._host_shapes.items():
            a = self._host[key].get(field)
            if a is None or a.shape != shape or a.dtype != dtype:
                got = "missing" if a is None else f"{a.dtype}{list(a.shape)}"
                raise ValueError(
                    f"host table {name!r} field {field!r} is {got}, not {dtype}{list(shape)}: "
                    "write new values into the cache's host arrays in place (fields[...][:] = "
                    "values), then RowCache.clear() if rows are cached"
                )
        self._mover.check_host(self._host)

    def _apply(self, state: TrainState, staged: Staged | InPlace, serial: int) -> TrainState:
        wheres = [b.where for b in self._mover.buffers]
        new, pending = self._mover.apply(_arrays(state, wheres), staged, self._host)
        self._inflight.hold(pending, serial)
        return replace_tables(state, dict(zip(wheres, new, strict=True)), {})

    def load_batch(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        """``(state, batch)`` ready for any computation on the model other than a train
        step (evaluation, predictions): the batch's rows loaded, its ids as slots.
        Without it a cached table would be read at the raw ids' slots."""
        prepared = self.prepare(batch)
        return self.load(state, prepared), prepared.batch

    def write_back(self) -> None:
        """Waits for the last load's evicted rows and writes them to host memory (kept
        for another try if that fails)."""
        if self._inflight.pending is not None:
            with _annotate("write_back"):  # mostly a wait for the last load's program
                self._inflight.write_back()

    def flush(self, state: TrainState) -> TrainState:
        """Copies every cached row (and its optimizer rows) to host memory, so the host
        tables are the model's current tables (before a checkpoint or an export). The
        rows stay cached, and ``state`` stays valid (it is returned; only read). It may
        run while a pipeline has batches prefetched (prepared, not loaded): the rows
        copied are those the device holds."""
        with self._lock:  # no batch is prepared meanwhile: the maps hold still
            if self._held is not None:  # a refused load: its rows are the cache's now
                state = self.load(state, self._held)
            self.write_back()
            moves = {t.key: self._device_view(t) for t in self.tables.values()}
            wheres = [b.where for b in self._mover.buffers]
            none = np.zeros(0, np.int64)
            most = max([0, *(len(es) for es, _ in moves.values())])
            for lo in range(0, most, _FLUSH_ROWS):  # a bounded temporary, not the cache's size
                chunk = {
                    k: Move(none, none, es[lo : lo + _FLUSH_ROWS], er[lo : lo + _FLUSH_ROWS])
                    for k, (es, er) in moves.items()
                }
                staged = self._mover.stage(chunk, self._host)
                if staged is not None:  # copies out only: nothing donated, the state stays
                    pending = self._mover.copy_out(_arrays(state, wheres), staged, self._host)
                    pending.write_back()
            return state

    def _device_view(self, t: CachedTable) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, logical rows)`` of table ``t`` that the device holds: the maps' less
        the moves of batches prepared and not loaded yet (call under ``_lock``)."""
        later = [m[t.key] for _, (m, _) in sorted(self._unloaded.items())]
        return device_rows(*self.cached(t.name), later)

    def cached(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, logical rows)`` of table ``name``'s occupied slots as the slot maps
        say (this process's shards; batches prepared and not loaded yet included)."""
        if self._maps is not None:
            return self._maps.cached(name)
        t = self.tables[name]
        slots, rows = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for s, m in enumerate(t.maps):
            if m is not None:
                sl, r = m.cached()
                slots.append(sl + s * t.slots)
                rows.append(r + s * t.shard_rows)
        return np.concatenate(slots), np.concatenate(rows)

    def discard_prefetched(self, state: TrainState) -> TrainState:
        """Loads every prepared batch not loaded yet, without its step: the batches a
        pipeline had prefetched when it stopped (``TrainPipeline.close`` drops them, and
        the maps already count their rows as cached). Their rows are then in their slots
        and training goes on with any new batch; the discarded batches are not trained
        on. Call it once the pipeline has stopped: a batch it still holds is refused."""
        with self._lock:
            first = self._loaded + 1
            try:
                for serial in range(first, self._prepared + 1):
                    if serial not in self._unloaded:  # its prepare failed after planning
                        raise RuntimeError(
                            f"prepared batch {serial} has no move to load (its prepare "
                            "failed after planning): restore the cache from a checkpoint"
                        )
                    staged = self._unloaded[serial][1]
                    state = self._load(state, Prepared(None, staged, serial))
            except Exception as e:
                if self._loaded < first:  # nothing loaded: the caller's state is valid
                    raise
                # earlier loads here took the caller's buffers: hand back the state
                hand_back(
                    e,
                    state,
                    "jaxrec.cache: earlier batches were loaded, and the state "
                    "passed in was donated to them: go on with err.state",
                )
                raise
            return state

    def clear(self) -> None:
        """Forgets what is cached (after the host tables were replaced, e.g. restored)."""
        self._held = None
        self._inflight.clear()
        self._unloaded = {}
        self._prepared = self._loaded = 0
        self._changes = None  # the host tables were replaced: a new delta base is needed
        if self._maps is not None:
            self._maps.clear()
        for t in self.tables.values():
            for m in t.maps:
                if m is not None:
                    m.clear()

    def host_fields(self) -> dict[str, HostRows]:
        """``{checkpoint key: HostRows}``: what a checkpoint saves for the cached tables,
        this process's rows of each (call :meth:`flush` first)."""
        return {
            t.key: HostRows(t.host.fields, t.host.rows[0], t.host.config.num_embeddings)
            for t in self.tables.values()
        }

    def save(
        self, manager: CheckpointManager, step: int, state: TrainState, **kwargs: Any
    ) -> TrainState:
        """Flushes the cache (:meth:`flush`: also while a pipeline has batches
        prefetched) and saves the state with the host tables in place of the device
        caches (``CheckpointManager.save``; synchronous). Returns ``state``, which stays
        valid. With several processes, each writes its own host rows."""
        state = self.flush(state)
        manager.save(
            step, self.graphdef, self.optimizer, state, host_tables=self.host_fields(), **kwargs
        )
        return state

    def restore(
        self, manager: CheckpointManager, target: TrainState, *, step: int | None = None
    ) -> TrainState:
        """Restores a checkpoint (of this model, cached or not, any plan) into the host
        tables and ``target``; the cache starts empty. A restore refused before it
        reads (no such step, another model) leaves the cache as it was; one that fails
        while reading leaves the host tables partly written: restore again (``resume``
        falls back by itself)."""
        self.write_back()  # nothing may still write to the host tables
        state = manager.restore(
            self.graphdef, self.optimizer, target, step=step, host_tables=self.host_fields()
        )
        self.clear()  # the host tables were replaced: what the slots held is stale
        return state

    # ----- delta checkpoints (ModelDeltaTracker; see changes.py) -----
    def save_base(
        self, tracker: ModelDeltaTracker, step: int, state: TrainState, **kwargs: Any
    ) -> Published:
        """A full checkpoint of the logical tables (as :meth:`save`) that ``tracker``'s next
        deltas follow (``ModelDeltaTracker.save_base``); from here on the rows loads write
        back are recorded. Train on from the returned ``Published.state``."""
        state = self.flush(state)
        published = tracker.save_base(
            step, self.graphdef, self.optimizer, state, host_tables=self.host_fields(), **kwargs
        )
        self._changes = ChangedRows(self.tables.values())
        return published

    def publish_delta(
        self, tracker: ModelDeltaTracker, step: int, state: TrainState, **kwargs: Any
    ) -> Published:
        """Flushes the cache and publishes the delta since the last link
        (``ModelDeltaTracker.publish``): a cached table's rows that a marked slot holds or
        that loads wrote back since the link (``changes.py``), from the host tables. The
        model of slots must be tracked (``track_touched_rows``). Train on from the
        returned ``Published.state`` (its marks cleared).

        Raises:
            ValueError: no base since the cache was built or cleared (call
                :meth:`save_base` or :meth:`restore_deltas`), or as ``publish`` does.
        """
        if self._changes is None:
            raise ValueError(
                "publish_delta: no delta base since the cache was built or cleared (restore, "
                "clear); call RowCache.save_base (or restore_deltas), not the tracker's own"
            )
        state = self.flush(state)
        with self._lock:  # the maps and the prepared batches hold still
            held = {t.key: self._device_view(t) for t in self.tables.values()}
        rows = changed_rows(self._changes, marked(self.graphdef, state), held)
        published = tracker.publish(
            step,
            self.graphdef,
            self.optimizer,
            state,
            host_tables=self.host_fields(),
            changed_rows=rows,
            **kwargs,
        )
        self._changes.clear()
        return published

    def restore_deltas(
        self, tracker: ModelDeltaTracker, target: TrainState, *, step: int | None = None
    ) -> Restored:
        """``ModelDeltaTracker.restore`` (a full checkpoint, then its deltas, up to ``step``;
        of this model, cached or not, any plan) into the host tables and ``target``; the
        cache starts empty, and the next :meth:`publish_delta` follows the restored link."""
        self.write_back()  # nothing may still write to the host tables
        restored = tracker.restore(
            self.graphdef, self.optimizer, target, step=step, host_tables=self.host_fields()
        )
        self.clear()
        self._changes = ChangedRows(self.tables.values())
        return restored

    def resume(self, manager: CheckpointManager, state: TrainState) -> tuple[TrainState, int]:
        """``CheckpointManager.resume`` into the host tables; the cache starts empty when a
        step was restored (with none, nothing changes)."""
        self.write_back()
        state, step = manager.resume(
            self.graphdef, self.optimizer, state, host_tables=self.host_fields()
        )
        if step:
            self.clear()
        return state, step

    def close(self) -> None:
        """Closes the connections to the other processes (several processes; the
        threads' and sockets' end). Every process closes its cache at the job's end;
        a later ``prepare`` raises."""
        self._closed = True
        if self._peers is not None:
            self._peers.close()

    def reset_stats(self) -> None:
        self.stats = {name: CacheStats() for name in self.tables}


# ids per table from which tables are planned on threads: below, a table's C++ passes
# take well under a millisecond and handing them to threads costs more than it saves
# (4 tables, 2 cores: 41k ids each 6.2 -> 6.5 ms; 164k ids each 37 -> 30 ms)
_THREAD_IDS = 1 << 16
# cached rows a flush copies at a time, per table: its temporaries (positions, the rows
# in pinned host memory off the CPU) stay bounded, not the size of the cache (tens of GB
# at production size); 64 MB of 1 KB rows
_FLUSH_ROWS = 1 << 16
_CACHES = itertools.count()  # RowCache objects made in this process: their exchange tags
_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(n: int) -> ThreadPoolExecutor:
    """A shared pool of ``n`` planning threads (idle ones cost nothing); per process: a
    forked child has none of its parent's threads."""
    key = (os.getpid(), n)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = ThreadPoolExecutor(n, thread_name_prefix="jaxrec-cache")
        return _POOLS[key]


def _on_host(slot_maps: str | None, platforms: set[str]) -> bool:
    """Whether the slot maps are the host's (``"host"``) or the device's (``"device"``).
    Default: the device's with one process whose slot tables are off the CPU; the
    host's with several processes, and on a CPU, where the device is the host and the
    host maps' passes plan a batch in less time (4 tables of 41K ids: 7.3 ms against
    14.8 ms, bench/results/cache_cpu_xeon207_2core_2026-11-29_slot_maps.jsonl)."""
    if slot_maps is None:
        return jax.process_count() > 1 or platforms <= {"cpu"}
    if slot_maps not in ("device", "host"):
        raise ValueError(f'RowCache slot_maps must be "device", "host" or None, got {slot_maps!r}')
    if slot_maps == "device" and jax.process_count() > 1:
        raise ValueError(
            'RowCache(slot_maps="device") plans on one process\'s devices only: with '
            f'{jax.process_count()} processes use slot_maps="host" (the default there)'
        )
    return slot_maps == "host"


def _arrays(state: TrainState, wheres: list[tuple]) -> list[jax.Array]:
    """The state's buffers at ``wheres`` (``Buffer.where``), without merging the model."""
    tables = {
        ("tables", components(p)[:-1]): x
        for p, x in jax.tree_util.tree_leaves_with_path(state.tables)
    }
    out = []
    for w in wheres:
        if w[0] == "tables":
            out.append(tables[w])
        else:
            out.append(getattr(state.opt_state.sparse[w[1]], w[2]))
    return out


def _annotate(phase: str) -> jax.profiler.TraceAnnotation:
    """A span named ``jaxrec.cache.<phase>`` in a ``jax.profiler`` trace (the cache's
    host phases beside the device programs; ``bench/cache_timeline.py`` reads them)."""
    return jax.profiler.TraceAnnotation(f"jaxrec.cache.{phase}")
