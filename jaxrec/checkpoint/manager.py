"""CheckpointManager: per-shard, streaming, checksummed checkpoints in the logical layout.

A step is a directory ``<step>/`` holding ``meta.json`` (format, step, the spec
of ``spec.py``, the caller's metadata, the index of every array; checksummed),
``tables/<id>/<field>/<row>_<col>`` (pieces of each table's weight and optimizer
state fields in natural row order, see ``stream.py``) and ``dense/<part>/<i>``
(dense leaves, see ``dense.py``): zarr v3 arrays whose every chunk carries a
CRC32C checksum. It restores under any sharding plan and device count.

A step is written into ``<step>.partial/`` and renamed when complete, so a
process killed mid-save leaves nothing a restore would pick. Multi-process runs:
every process calls ``save`` (each writes its own shards, then an index of
them; the primary process merges the indices, writes ``meta.json`` and renames)
and ``restore`` (each reads what its devices hold). The directory must be on a
filesystem every process sees, with POSIX rename.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from ..embedding.optimizer import CombinedOptimizer
from ..train.step import TrainState
from . import dense, legacy, stream
from .layout import HostTables, replace_tables, table_buffers
from .logical import common_count, place_dense
from .paths import nest
from .spec import DENSE_PARTS, check_caches, check_compatible, state_spec
from .store import CheckpointCorruptError

FORMAT = "jaxrec.checkpoint/2"
PARTIAL = ".partial"
logger = logging.getLogger("jaxrec")


class CheckpointManager:
    """Saves and restores train states under ``directory/<step>/``.

    No TorchRec class matches (TorchRec checkpoints its sharded ``state_dict``
    with ``torch.distributed.checkpoint``, each rank writing its own shards, as
    here); the options are orbax's ``CheckpointManager``'s.

    Host memory: a save or restore holds at most ``staging_bytes`` of table rows
    in host memory at a time, plus, for an asynchronous save, a host copy of the
    process's own shards (taken before ``save`` returns, so the next, donating,
    step may run at once). Dense leaves are copied a shard at a time.

    Args:
        directory: where the step directories go (created if needed).
        max_to_keep: keep only the newest N steps (``None``: keep all).
        async_save: write in a background thread. A save that returned is on
            disk when the process ends (normal exit, an exception, ``sys.exit``):
            the writer is waited for at exit.
        save_interval_steps: ``save`` without ``force`` skips steps that are not
            a multiple of it, except the first save in an empty directory, and
            steps not after the latest saved one (orbax's policy).
        staging_bytes: the host buffer for table rows (default 64 MiB).
        commit_timeout_s: how long processes wait for each other to finish a step.
        host_views: save a CPU device's table shards through zero-copy views of its
            memory; ``False``: slice them on the device and copy a staging window at
            a time, as off the CPU (tests take that path on a CPU).

    Example:
        >>> mgr = CheckpointManager("/tmp/run", max_to_keep=3)
        >>> graphdef, state = init_train_state(model, optimizer)
        >>> state, start = mgr.resume(graphdef, optimizer, state)  # (state, 0) on a fresh run
        >>> for step in range(start, num_steps):
        ...     state, loss, _ = train_step(state, batches[step])
        ...     mgr.save(step + 1, graphdef, optimizer, state)
        >>> mgr.close()
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        async_save: bool = True,
        save_interval_steps: int = 1,
        staging_bytes: int = stream.STAGING_BYTES,
        commit_timeout_s: float = 1800.0,
        host_views: bool = True,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 or None, got {max_to_keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        os.makedirs(self.directory, exist_ok=True)
        self.max_to_keep = max_to_keep
        self.async_save = async_save
        self.save_interval_steps = max(1, int(save_interval_steps))
        self.staging_bytes = int(staging_bytes)
        self.commit_timeout_s = commit_timeout_s
        self.host_views = host_views
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        _LIVE.add(self)

    def save(
        self,
        step: int,
        graphdef: nnx.GraphDef,
        optimizer: CombinedOptimizer,
        state: TrainState,
        *,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
        host_tables: HostTables | None = None,
    ) -> bool:
        """Saves ``state`` (any plan) as step ``step``; returns whether it saved.

        Args:
            step: the step number (by convention, training steps completed).
            graphdef, optimizer, state: as given to ``make_train_step``.
            metadata: JSON-serialisable extras (data position, config, ...);
                read back with :meth:`metadata`.
            force: save even where ``save_interval_steps`` would skip the step.
            host_tables: tables kept in host memory (``RowCache.host_fields()``,
                after ``RowCache.flush``): saved as their tables, in place of their
                device caches (a :class:`HostRows` part: each process writes its
                own rows). Such a save is synchronous (training writes the host
                rows in place), whatever ``async_save`` says.

        Raises:
            the error of an earlier asynchronous save that failed (that step was
            not written; this one is not started).
            ValueError: ``state`` has a device cache (``jaxrec.cache``) without its
                host table in ``host_tables`` (nothing is written).
        """
        step = int(step)
        user = dict(metadata or {})
        try:
            json.dumps(user)
        except TypeError as e:
            raise TypeError(f"metadata must be JSON-serialisable: {e}") from None
        self.wait_until_finished()
        if not self._should_save(step, force):
            return False
        check_caches(graphdef, state, host_tables)
        layout = table_buffers(graphdef, optimizer, state, host_tables)
        spec = state_spec(graphdef, optimizer, state, host_tables)
        ids = {key: i for i, key in enumerate(sorted(spec["tables"]))}
        parts = dict(zip(DENSE_PARTS, _dense_parts(state), strict=True))
        meta = {
            "format": FORMAT,
            "step": step,
            "spec": spec,
            "metadata": user,
            "tables": {k: {"id": i, "count": None, "pieces": {}} for k, i in ids.items()},
            "dense": {name: dense.index_entries(tree) for name, tree in parts.items()},
        }
        for key, tables in layout.shared_counts.items():
            count = int(np.asarray(_local(state.opt_state.sparse[key].count)))
            for t in tables:
                meta["tables"][t]["count"] = count
        partial = self._path(step) + PARTIAL
        if jax.process_index() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(os.path.join(partial, "index"))
            for name, entries in meta["dense"].items():
                dense.create(partial, name, entries)
        _barrier(f"jaxrec_checkpoint_start_{step}")
        copy = self.async_save and not host_tables
        tables = [
            (buf, stream.shard_sources(buf, copy, self.staging_bytes, host_views=self.host_views))
            for buf in layout.buffers
        ]
        shards = {name: dense.snapshot(tree, copy) for name, tree in parts.items()}
        if not copy:
            self._write(step, partial, meta, ids, tables, shards)
            return True
        self._thread = threading.Thread(
            target=self._write_in_background,
            args=(step, partial, meta, ids, tables, shards),
            name=f"jaxrec-checkpoint-{step}",
        )  # not a daemon: the interpreter waits for it at exit
        self._thread.start()
        return True

    def restore(
        self,
        graphdef: nnx.GraphDef,
        optimizer: CombinedOptimizer,
        target: TrainState,
        *,
        step: int | None = None,
        host_tables: HostTables | None = None,
    ) -> TrainState:
        """The saved state in ``target``'s plan, layout and shardings.

        ``target`` only gives structure and shardings (build it with
        ``init_train_state`` on the model sharded as wanted); its values are not
        read. Each device's shard is filled in place, ``staging_bytes`` of rows
        at a time, from the pieces of the logical tables it holds; every chunk
        read is checked against its checksum.

        Args:
            step: the step to restore (default: the latest).
            host_tables: tables kept in host memory (``RowCache.host_fields()``):
                filled in place with the saved tables (then ``RowCache.clear()``).

        Raises:
            FileNotFoundError: no such step.
            ValueError: the checkpoint does not fit the target model/optimizer
                (every difference is listed), or the target has a device cache
                (``jaxrec.cache``) without its host table in ``host_tables``.
            CheckpointCorruptError: a file of the step is damaged or missing
                (the message names the step, the array and the file).
        """
        step = self._step(step)
        what = f"checkpoint step {step} in {self.directory}"
        meta = self._meta(step)
        check_caches(graphdef, target, host_tables)
        expected = state_spec(graphdef, optimizer, target, host_tables)
        check_compatible(meta["spec"], expected, what)
        step_dir = self._path(step)
        if meta["format"] == legacy.FORMAT:
            return legacy.restore(step_dir, meta, graphdef, optimizer, target, what)
        ids = {k: t["id"] for k, t in meta["tables"].items()}
        layout = table_buffers(graphdef, optimizer, target, host_tables)
        arrays = {}
        for buf in layout.buffers:
            tables = {b.table for b in buf.blocks}
            pieces = {t: _pieces(meta, t, buf.field) for t in tables}
            arrays[buf.where] = stream.restore_buffer(
                step_dir, buf, pieces, ids, what, self.staging_bytes
            )
        counts = {}
        for key, tables in layout.shared_counts.items():
            like = target.opt_state.sparse[key].count
            saved = {t: {"count": meta["tables"][t]["count"]} for t in tables}
            counts[key] = _replicate(common_count(tables, saved, like.dtype), like)
        state = replace_tables(target, arrays, counts)
        placed = {}
        for name, tree in zip(DENSE_PARTS, _dense_parts(target), strict=True):
            values = dense.restore(step_dir, name, meta["dense"][name], tree, what)
            placed[name] = place_dense(nest(list(values.items())), tree)
        return state._replace(
            params=placed["params"],
            rest=placed["rest"],
            opt_state=state.opt_state._replace(dense=placed["dense_opt"]),
        )

    def resume(
        self,
        graphdef: nnx.GraphDef,
        optimizer: CombinedOptimizer,
        state: TrainState,
        *,
        host_tables: HostTables | None = None,
    ) -> tuple[TrainState, int]:
        """``(newest intact saved state in state's layout, its step)``, or ``(state, 0)`` if
        there is no checkpoint.

        A damaged step (:class:`CheckpointCorruptError`) is skipped with a warning
        naming it and the reason; the next older one is tried. If every step is
        damaged, the error lists them (training is not silently restarted).
        """
        skipped = []
        for step in reversed(self.all_steps()):
            restored, error = None, None
            try:
                restored = self.restore(
                    graphdef, optimizer, state, step=step, host_tables=host_tables
                )
            except CheckpointCorruptError as e:
                error = str(e)
            if _all_processes(error is None):  # one collective per step on every process
                assert restored is not None  # no error here, so restore returned
                return restored, step
            if error is None:
                error = "damaged in the shards another process reads (see its warning)"
            warnings.warn(
                f"resume: skipping damaged checkpoint step {step}: {error}",
                CheckpointWarning,
                stacklevel=2,
            )
            skipped.append(f"step {step}: {error}")
        if skipped:
            raise CheckpointCorruptError(
                f"every checkpoint in {self.directory} is damaged:\n  " + "\n  ".join(skipped)
            )
        return state, 0

    def metadata(self, step: int | None = None) -> dict:
        """The ``metadata`` given to :meth:`save` for ``step`` (default: the latest)."""
        return self._meta(self._step(step))["metadata"]

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """The committed steps (directories named by an integer), oldest first; waits for
        a pending save."""
        self.wait_until_finished()
        return self._listed_steps()

    def _listed_steps(self) -> list[int]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(self._path(n)))

    def wait_until_finished(self) -> None:
        """Blocks until a pending asynchronous save is on disk; raises its error, if any."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Waits for a pending save (raising its error, if any)."""
        self.wait_until_finished()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- internals -----
    def _path(self, step) -> str:
        return os.path.join(self.directory, str(step))

    def _should_save(self, step: int, force: bool) -> bool:
        latest = self.latest_step()
        if latest is not None and step <= latest:
            return False
        return force or latest is None or step % self.save_interval_steps == 0

    def _step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
            return steps[-1]
        if int(step) not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; steps: {steps}"
            )
        return int(step)

    def _meta(self, step: int) -> dict:
        step_dir = self._path(step)
        if legacy.is_legacy(step_dir):
            meta = legacy.read_meta(step_dir)
            if meta.get("format") != legacy.FORMAT:
                raise ValueError(f"{step_dir} is not a jaxrec checkpoint")
            return meta
        return read_meta(os.path.join(step_dir, "meta.json"))

    def _write_in_background(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # noqa: BLE001  (re-raised by wait_until_finished)
            self._error = e

    def _write(self, step, partial, meta, ids, tables, shards) -> None:
        pieces: dict = {}
        for buf, sources in tables:
            written = stream.save_buffer(partial, buf, sources, ids, self.staging_bytes)
            for table, ps in written.items():
                pieces.setdefault(table, {}).setdefault(buf.field, []).extend(map(list, ps))
        for name, leaf_shards in shards.items():
            dense.save(partial, name, meta["dense"][name], leaf_shards)
        write_json(os.path.join(partial, "index", f"{jax.process_index()}.json"), pieces)
        final = self._path(step)
        if jax.process_index() == 0:
            self._commit(partial, final, meta)
        else:
            _wait_for(
                lambda: os.path.isfile(os.path.join(final, "meta.json")),
                self.commit_timeout_s,
                f"process 0 to commit {final}",
            )

    def _commit(self, partial: str, final: str, meta: dict) -> None:
        index = os.path.join(partial, "index")
        files = [os.path.join(index, f"{i}.json") for i in range(jax.process_count())]
        _wait_for(
            lambda: all(map(os.path.isfile, files)),
            self.commit_timeout_s,
            f"every process's index in {index}",
        )
        for path in files:
            with open(path) as f:
                for table, fields in json.load(f).items():
                    for field, ps in fields.items():
                        meta["tables"][table]["pieces"].setdefault(field, []).extend(ps)
        write_json(os.path.join(partial, "meta.json"), meta, checksum=True)
        _fsync_dir(partial)
        os.rename(partial, final)
        _fsync_dir(self.directory)
        if self.max_to_keep is not None:
            for old in self._listed_steps()[: -self.max_to_keep]:
                shutil.rmtree(self._path(old), ignore_errors=True)


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped."""


def read_meta(path: str) -> dict:
    """A step's ``meta.json``, its checksum verified."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{path} is unreadable: {e}") from None
    if not isinstance(raw, dict) or "sha256" not in raw or "meta" not in raw:
        raise CheckpointCorruptError(f"{path} is not a jaxrec checkpoint index")
    if _digest(raw["meta"]) != raw["sha256"]:
        raise CheckpointCorruptError(f"{path}: checksum mismatch (the file is damaged)")
    meta = raw["meta"]
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, this jaxrec reads {FORMAT!r}")
    return meta


def write_json(path: str, value: Any, *, checksum: bool = False) -> None:
    """Writes ``path`` whole or not at all (a temporary file, fsync, rename)."""
    if checksum:
        value = {"sha256": _digest(value), "meta": value}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _pieces(meta: dict, table: str, field: str) -> list[stream.Piece]:
    return [stream.Piece(*p) for p in meta["tables"][table]["pieces"].get(field, [])]


def _dense_parts(state: TrainState) -> tuple:
    return state.params, state.rest, state.opt_state.dense


def _local(x):
    return x.addressable_data(0) if isinstance(x, jax.Array) else x


def _replicate(value: np.ndarray, like: jax.Array) -> jax.Array:
    return jax.make_array_from_callback(like.shape, like.sharding, lambda idx: value[idx])


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _all_processes(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (all processes must resume one step)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _wait_for(done, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint: waited {timeout_s:.0f} s for {what}")
        time.sleep(0.05)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _finish_pending_saves() -> None:
    """A save that returned is on disk when the interpreter exits (normally, by an
    exception or ``sys.exit``)."""
    for mgr in list(_LIVE):
        try:
            mgr.wait_until_finished()
        except BaseException as e:  # noqa: BLE001  (exiting: report, do not raise)
            logger.error("checkpoint: a pending save failed at exit: %s", e)
