"""Delta checkpoints: only the table rows changed since the last publish, for online training.

Online training publishes its model every few minutes; rewriting tables of
billions of rows each time is too slow, so a :class:`ModelDeltaTracker`
(TorchRec's name, ``torchrec.distributed.model_tracker``, in its EMBEDDING
mode: ids with their rows and optimizer state rows) writes a full checkpoint
now and then (:meth:`~ModelDeltaTracker.save_base`) and in between *deltas*
(:meth:`~ModelDeltaTracker.publish`): per table the ids of the rows train
steps looked up since the previous link (marked on the device, see
``jaxrec.embedding.touched``), those rows of the weights and of every
optimizer state field, the optimizer step counts, and the dense parts (params,
other variables, dense optax state: small) whole.

A delta is a directory ``<manager dir>/deltas/<step>/`` in the full
checkpoints' conventions (``manager.py``): zarr arrays with a CRC32C per chunk,
each process writing the rows of its own shards, an index per process merged
by process 0 into a checksummed ``meta.json`` (with the spec of ``spec.py``),
and a rename from ``<step>.partial`` when complete. Each delta names its
parent (the full checkpoint or delta it follows) by step and the SHA-256 of
its ``meta.json``: :meth:`~ModelDeltaTracker.apply_delta` refuses a delta on
any other state, and :meth:`~ModelDeltaTracker.restore` (the full checkpoint,
then its deltas in order) gives the trained state bit for bit, under any plan.

Cached tables (``jaxrec.cache``): their slot tables' marks are over slots, so
``RowCache.save_base`` / ``publish_delta`` / ``restore_deltas`` pass the host tables
(``host_tables=``, written and read in host memory) and, publishing, each one's
changed logical rows (``changed_rows=``, found by the cache: ``cache/changes.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from ..embedding.optimizer import CombinedOptimizer
from ..train.step import TrainState
from . import dense, store
from .delta_rows import (
    RowPiece,
    clear_marks,
    gather_pieces,
    host_pieces,
    is_host,
    join_pieces,
    scatter_host,
    scatter_rows,
    touched_ids,
)
from .layout import HostTables, replace_tables, table_buffers
from .logical import common_count, place_dense
from .manager import (
    PARTIAL,
    CheckpointManager,
    _barrier,
    _digest,
    _fsync_dir,
    _replicate,
    _wait_for,
    write_json,
)
from .paths import nest
from .spec import DENSE_PARTS, check_compatible, state_spec

FORMAT = "jaxrec.delta/1"
DELTAS = "deltas"  # under the manager's directory


class Link(NamedTuple):
    """One link of a delta chain: a full checkpoint (``kind="full"``) or a delta, its step
    and the SHA-256 of its ``meta.json`` (what the next delta names as its parent)."""

    kind: str
    step: int
    digest: str


class Published(NamedTuple):
    """What :meth:`ModelDeltaTracker.publish` / ``save_base`` did."""

    state: TrainState  # the state with its marks cleared (train on from this one)
    link: Link  # what was written
    rows: dict[str, int]  # table key -> rows written (a full save: every row)


class Restored(NamedTuple):
    """A state rebuilt from a chain, and the last link applied to it."""

    state: TrainState
    link: Link


class ModelDeltaTracker:
    """Publishes deltas of a tracked model between the full checkpoints of ``manager``.

    The model must carry touched-row marks (``jaxrec.embedding.track_touched_rows``,
    before ``init_train_state``). Every process of a run calls each method.

    Args:
        manager: the :class:`CheckpointManager` of the full checkpoints; deltas go
            to ``<manager.directory>/deltas/<step>/``.

    Example:
        >>> model = track_touched_rows(model)
        >>> graphdef, state = init_train_state(model, optimizer)
        >>> tracker = ModelDeltaTracker(CheckpointManager("/tmp/run"))
        >>> state = tracker.save_base(0, graphdef, optimizer, state).state
        >>> for step in range(1, num_steps + 1):
        ...     state, loss, _ = train_step(state, batches[step])
        ...     if step % 100 == 0:
        ...         state = tracker.publish(step, graphdef, optimizer, state).state
        >>> # a serving copy or a warm standby, under any plan:
        >>> state, link = tracker.restore(graphdef, optimizer, target)
    """

    def __init__(self, manager: CheckpointManager):
        if not isinstance(manager, CheckpointManager):
            raise TypeError(f"manager must be a CheckpointManager, got {type(manager).__name__}")
        self.manager = manager
        self.directory = os.path.join(manager.directory, DELTAS)
        self.last: Link | None = None  # the link the next delta follows

    # ----- writing -----
    def save_base(
        self,
        step: int,
        graphdef: nnx.GraphDef,
        optimizer: CombinedOptimizer,
        state: TrainState,
        *,
        metadata: Mapping[str, Any] | None = None,
        host_tables: HostTables | None = None,
    ) -> Published:
        """A full checkpoint (``manager.save``, forced, waited for) that the next deltas
        follow; clears the marks. ``host_tables``: as for ``manager.save`` (a cached
        model: use ``RowCache.save_base``, which passes them).

        Raises:
            ValueError: ``step`` is not after the latest full checkpoint.
        """
        step = int(step)
        saved = self.manager.save(
            step, graphdef, optimizer, state, metadata=metadata, force=True, host_tables=host_tables
        )
        if not saved:
            raise ValueError(
                f"save_base: step {step} is not after the latest full checkpoint "
                f"{self.manager.latest_step()} in {self.manager.directory}; pass a later step"
            )
        self.manager.wait_until_finished()
        self.last = self.full_link(step)
        spec = self.manager._meta(step)["spec"]["tables"]
        rows = {k: int(t["shape"][0]) for k, t in spec.items()}
        return Published(clear_marks(state), self.last, rows)

    def publish(
        self,
        step: int,
        graphdef: nnx.GraphDef,
        optimizer: CombinedOptimizer,
        state: TrainState,
        *,
        metadata: Mapping[str, Any] | None = None,
        host_tables: HostTables | None = None,
        changed_rows: Mapping[str, np.ndarray] | None = None,
    ) -> Published:
        """Writes the delta of ``state`` since the last link as step ``step`` (synchronous:
        the next, donating, step may run once it returns) and clears the marks.

        Args:
            step: the step number, after the last link's.
            graphdef, optimizer, state: as given to ``make_train_step``.
            metadata: JSON-serialisable extras, stored in the delta's ``meta.json``.
            host_tables, changed_rows: tables kept in host memory (``jaxrec.cache``,
                flushed), by table key, and their changed logical rows (ascending int64)
                in place of their slot tables' marks: ``RowCache.publish_delta`` passes
                them.

        Returns:
            :class:`Published`: train on from its ``state`` (the marks cleared).

        Raises:
            ValueError: no base yet (call :meth:`save_base` or :meth:`restore`), ``step``
                not after the last link, the model is not tracked, or it has a device
                cache (``jaxrec.cache``) without its host table and changed rows.
        """
        step = int(step)
        if self.last is None:
            raise ValueError(
                "publish: no full checkpoint to follow; call save_base (or restore) first"
            )
        if step <= self.last.step:
            raise ValueError(
                f"publish: step {step} is not after the last link (step {self.last.step})"
            )
        user = dict(metadata or {})
        try:
            json.dumps(user)
        except TypeError as e:
            raise TypeError(f"metadata must be JSON-serialisable: {e}") from None
        if set(host_tables or {}) != set(changed_rows or {}):
            raise ValueError(
                f"publish: host_tables {sorted(host_tables or {})} and changed_rows "
                f"{sorted(changed_rows or {})} must name the same tables"
            )
        ids = touched_ids(graphdef, state, host=changed_rows)
        layout = table_buffers(graphdef, optimizer, state, host_tables)
        spec = state_spec(graphdef, optimizer, state, host_tables)
        table_ids = {key: i for i, key in enumerate(sorted(spec["tables"]))}
        parts = dict(zip(DENSE_PARTS, _dense_parts(state), strict=True))
        meta = {
            "format": FORMAT,
            "step": step,
            "parent": self.last._asdict(),
            "spec": spec,
            "metadata": user,
            "tables": {k: {"id": i, "count": None, "pieces": {}} for k, i in table_ids.items()},
            "dense": {name: dense.index_entries(tree) for name, tree in parts.items()},
        }
        for key, tables in layout.shared_counts.items():
            count = int(np.asarray(state.opt_state.sparse[key].count.addressable_data(0)))
            for t in tables:
                meta["tables"][t]["count"] = count
        partial = self._path(step) + PARTIAL
        if jax.process_index() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(os.path.join(partial, "index"))
            for name, entries in meta["dense"].items():
                dense.create(partial, name, entries)
        _barrier(f"jaxrec_delta_start_{step}")
        index: dict = {}
        for buf in layout.buffers:
            pieces = host_pieces(buf, ids) if is_host(buf) else gather_pieces(buf, ids)
            for p, entry in zip(
                pieces, _write_pieces(partial, buf.field, pieces, table_ids), strict=True
            ):
                index.setdefault(p.table, {}).setdefault(buf.field, []).append(entry)
        for name, tree in parts.items():
            dense.save(partial, name, meta["dense"][name], dense.snapshot(tree, False))
        write_json(os.path.join(partial, "index", f"{jax.process_index()}.json"), index)
        final = self._path(step)
        if jax.process_index() == 0:
            self._commit(partial, final, meta)
        else:
            _wait_for(
                lambda: os.path.isfile(os.path.join(final, "meta.json")),
                self.manager.commit_timeout_s,
                f"process 0 to commit {final}",
            )
        self.last = Link("delta", step, _read(os.path.join(final, "meta.json"))[1])
        return Published(clear_marks(state), self.last, {k: len(v) for k, v in ids.items()})

    def _commit(self, partial: str, final: str, meta: dict) -> None:
        index = os.path.join(partial, "index")
        files = [os.path.join(index, f"{i}.json") for i in range(jax.process_count())]
        _wait_for(
            lambda: all(map(os.path.isfile, files)),
            self.manager.commit_timeout_s,
            f"every process's index in {index}",
        )
        for path in files:
            with open(path) as f:
                for table, fields in json.load(f).items():
                    for field, ps in fields.items():
                        meta["tables"][table]["pieces"].setdefault(field, []).extend(ps)
        write_json(os.path.join(partial, "meta.json"), meta, checksum=True)
        _fsync_dir(partial)
        shutil.rmtree(final, ignore_errors=True)  # a delta of an abandoned chain
        os.rename(partial, final)
        _fsync_dir(self.directory)

    # ----- reading -----
    def apply_delta(
        self,
        step: int,
        graphdef: nnx.GraphDef,
        optimizer: CombinedOptimizer,
        state: TrainState,
        *,
        after: Link,
        host_tables: HostTables | None = None,
    ) -> Restored:
        """``state`` (at link ``after``; any plan) with delta ``step`` applied.

        ``state``'s table buffers are donated (updated in place): use the returned one.
        ``host_tables``: tables kept in host memory (``RowCache.host_fields()``), written
        in place (``RowCache.restore_deltas`` passes them and empties the cache).

        Raises:
            FileNotFoundError: no such delta.
            ValueError: the delta does not follow ``after`` (another base, a skipped or
                repeated delta), or does not fit the model.
            CheckpointCorruptError: a file of the delta is damaged or missing.
        """
        step = int(step)
        path = self._path(step)
        meta, digest = _read(os.path.join(path, "meta.json"))
        what = f"delta step {step} in {self.directory}"
        parent = Link(**meta["parent"])
        if parent != Link(*after):
            raise ValueError(
                f"{what} follows {parent.kind} step {parent.step} (sha256 "
                f"{parent.digest[:12]}...), but the state is at {after.kind} step {after.step} "
                f"(sha256 {after.digest[:12]}...): apply deltas in order, on the full "
                "checkpoint they were published after (ModelDeltaTracker.restore finds the chain)"
            )
        expected = state_spec(graphdef, optimizer, state, host_tables)
        check_compatible(meta["spec"], expected, what)
        layout = table_buffers(graphdef, optimizer, state, host_tables)
        tables = meta["spec"]["tables"]
        joined: dict = {}
        arrays = {}
        for buf in layout.buffers:
            rows = {}
            for t in {b.table for b in buf.blocks}:
                if (t, buf.field) not in joined:
                    joined[t, buf.field] = _read_field(path, meta, tables[t], t, buf.field, what)
                rows[t] = joined[t, buf.field]
            if is_host(buf):
                scatter_host(buf, rows)
                continue
            new = scatter_rows(buf, rows)
            if new is not None:
                arrays[buf.where] = new
        counts = {}
        for key, keys in layout.shared_counts.items():
            like = state.opt_state.sparse[key].count
            saved = {t: {"count": meta["tables"][t]["count"]} for t in keys}
            counts[key] = _replicate(common_count(keys, saved, like.dtype), like)
        state = replace_tables(state, arrays, counts)
        placed = {}
        for name, tree in zip(DENSE_PARTS, _dense_parts(state), strict=True):
            values = dense.restore(path, name, meta["dense"][name], tree, what)
            placed[name] = place_dense(nest(list(values.items())), tree)
        state = state._replace(
            params=placed["params"],
            rest=placed["rest"],
            opt_state=state.opt_state._replace(dense=placed["dense_opt"]),
        )
        return Restored(clear_marks(state), Link("delta", step, digest))

    def restore(
        self,
        graphdef: nnx.GraphDef,
        optimizer: CombinedOptimizer,
        target: TrainState,
        *,
        step: int | None = None,
        host_tables: HostTables | None = None,
    ) -> Restored:
        """The state at ``step`` (default: the newest link), in ``target``'s plan: its
        full checkpoint (``manager.restore``) and every delta after it in order. The next
        :meth:`publish` follows it. ``host_tables``: as for :meth:`apply_delta` (a cached
        model: use ``RowCache.restore_deltas``).

        Raises:
            FileNotFoundError: no chain reaches ``step`` (no such step, or its full
                checkpoint was removed).
        """
        chain = self.chain(step)
        state = self.manager.restore(
            graphdef, optimizer, target, step=chain[0].step, host_tables=host_tables
        )
        at = chain[0]
        for link in chain[1:]:
            state, at = self.apply_delta(
                link.step, graphdef, optimizer, state, after=at, host_tables=host_tables
            )
        self.last = at
        return Restored(clear_marks(state), at)

    def chain(self, step: int | None = None) -> list[Link]:
        """The links to apply to reach ``step`` (default: the newest reachable): a full
        checkpoint, then the deltas that follow it, oldest first."""
        children: dict[str, list[Link]] = {}
        for s in self.delta_steps():
            meta, digest = _read(os.path.join(self._path(s), "meta.json"))
            children.setdefault(meta["parent"]["digest"], []).append(Link("delta", s, digest))
        best: list[Link] | None = None
        for base in self.manager.all_steps():
            chain = [self.full_link(base)]
            while True:
                if step is not None and chain[-1].step == int(step):
                    return chain
                nxt = children.get(chain[-1].digest, [])
                if not nxt:
                    break
                chain.append(max(nxt, key=lambda link: link.step))
            if step is None and (best is None or chain[-1].step >= best[-1].step):
                best = chain
        if best is None:
            where = f"step {step}" if step is not None else "any step"
            raise FileNotFoundError(
                f"no full checkpoint in {self.manager.directory} with deltas reaching {where} "
                f"(full steps {self.manager.all_steps()}, delta steps {self.delta_steps()})"
            )
        return best

    def full_link(self, step: int) -> Link:
        """The :class:`Link` of the manager's full checkpoint ``step``."""
        return Link("full", int(step), _digest(self.manager._meta(int(step))))

    def delta_steps(self) -> list[int]:
        """The committed deltas' steps, oldest first."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names if n.isdigit())

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))


def _dense_parts(state: TrainState) -> tuple:
    return state.params, state.rest, state.opt_state.dense


def _piece_path(root: str, table_id: int, field: str, first: int, col: int) -> str:
    return os.path.join(root, "tables", str(table_id), field, f"{first}_{col}")


def _write_pieces(root, field, pieces: list[RowPiece], table_ids) -> list[list[int]]:
    """Writes each piece as two arrays (``<first>_<col>``: values, ``.ids``: ids);
    returns their index entries ``[first id, rows, col, cols]``."""
    items, values = [], []
    for p in pieces:
        path = _piece_path(root, table_ids[p.table], field, int(p.ids[0]), p.col)
        for where, x in ((path, p.values), (path + ".ids", p.ids)):
            items.append((where, x.shape, x.dtype, store.row_chunks(x.shape, x.dtype)))
            values.append(x)
    arrays = store.create(items)
    futures = [store.write(a, slice(None), x) for a, x in zip(arrays, values, strict=True)]
    for f in futures:
        f.result()
    return [[int(p.ids[0]), len(p.ids), p.col, p.cols] for p in pieces]


def _read_field(path, meta, spec, table, field, what):
    """One table field's delta rows, joined (``LogicalRows``)."""
    shape = spec["shape"] if field == "weight" else spec["state"][field]["shape"]
    dtype = np.dtype(spec["dtype"] if field == "weight" else spec["state"][field]["dtype"])
    dim = shape[1] if len(shape) == 2 else 0
    entries = meta["tables"][table]["pieces"].get(field, [])
    tid = meta["tables"][table]["id"]
    items = []
    for first, n, col, cols in entries:
        at = _piece_path(path, tid, field, first, col)
        vshape = (n, cols) if cols else (n,)
        items.append((at, vshape, dtype, store.row_chunks(vshape, dtype)))
        items.append((at + ".ids", (n,), np.int64, store.row_chunks((n,), np.int64)))
    name = f"{what}: table {table!r} field {field!r}"
    arrays = store.open_arrays(items, name)
    reads = [a.read() for a in arrays]
    try:
        got = [r.result() for r in reads]
    except Exception as e:  # noqa: BLE001  (TensorStore raises ValueError)
        raise store.CheckpointCorruptError(f"{name}: {store.short(e)}") from None
    pieces = [
        RowPiece(table, got[2 * i + 1], col, cols, got[2 * i])
        for i, (_, _, col, cols) in enumerate(entries)
    ]
    return join_pieces(pieces, shape[0], dim, dtype, name)


def _read(path: str) -> tuple[dict, str]:
    """A delta's ``meta.json`` and its digest, the checksum verified."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing (no such delta)") from None
    except (OSError, ValueError) as e:
        raise store.CheckpointCorruptError(f"{path} is unreadable: {e}") from None
    if not isinstance(raw, dict) or "sha256" not in raw or "meta" not in raw:
        raise store.CheckpointCorruptError(f"{path} is not a jaxrec delta index")
    if _digest(raw["meta"]) != raw["sha256"]:
        raise store.CheckpointCorruptError(f"{path}: checksum mismatch (the file is damaged)")
    meta = raw["meta"]
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, this jaxrec reads {FORMAT!r}")
    return meta, raw["sha256"]
