"""The rows of a delta: touched ids read from the marks, rows gathered out of table
buffers and scattered back into them, under any plan.

A delta holds, per table and field, pieces of logical rows: ``ids [K]`` (int64,
ascending) and their values ``[K, cols]`` for columns ``[col, col + cols)``
(``[K]`` for a row-wise optimizer field). Writing, each process cuts the shards
it writes along their blocks (as a full checkpoint does, see ``stream.py``) and
gathers only the marked rows on the device. Applying, the pieces of a table are
joined into whole logical rows and each block of the target buffer (any plan)
takes its rows and columns of them in one scatter per buffer.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from ..embedding.collection import embedding_collections
from ..embedding.touched import ATTRIBUTE, TouchedRows, is_tracked
from ..train.step import TrainState, merge_model
from .layout import Buffer
from .logical import gathered
from .paths import is_variable, table_key
from .stream import Blocks, _span, writes_shard


class RowPiece(NamedTuple):
    """Rows ``ids`` of a table field, columns ``[col, col + cols)`` (``cols`` 0: a
    row-wise field)."""

    table: str
    ids: np.ndarray  # [K] int64, ascending
    col: int
    cols: int
    values: np.ndarray  # [K, cols] or [K]


class LogicalRows(NamedTuple):
    """A table field's delta rows joined over its pieces: whole logical rows."""

    ids: np.ndarray  # [K] int64, ascending
    values: np.ndarray  # [K, dim] or [K]


def touched_ids(
    graphdef: nnx.GraphDef, state: TrainState, *, host: Mapping[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """``{table key: ascending int64 rows marked since the marks were cleared}``.

    Args:
        host: per device cache's table key (``jaxrec.cache``), its changed logical rows
            (the cache finds them: ``RowCache.publish_delta``); they replace the marks of
            its slot table, whose ids are slots, not rows.

    Raises:
        ValueError: a collection carries no marks (``track_touched_rows`` was not
            called on the trained model), or a table is a device cache of a host
            table that ``host`` does not name.
    """
    host = host or {}
    out = dict(marked(graphdef, state))
    cached = sorted(k for k, c in _cached(graphdef, state).items() if c and k not in host)
    if cached:
        raise ValueError(
            f"tables {cached} are device caches of host tables (jaxrec.cache): their marks "
            "are over slots, not rows; publish with RowCache.publish_delta, which adds the "
            "rows written back to the host tables"
        )
    if extra := sorted(set(host) - set(out)):
        raise ValueError(f"host rows given for tables the model does not have: {extra}")
    for key, rows in host.items():
        out[key] = np.asarray(rows, np.int64)
    return out


def marked(graphdef: nnx.GraphDef, state: TrainState) -> dict[str, np.ndarray]:
    """``{table key: ascending int64 ids marked}``, slot ids for a device cache's table.

    Raises:
        ValueError: a collection carries no marks.
    """
    model = merge_model(graphdef, state)
    out = {}
    for path, module in embedding_collections(model):
        where = ".".join(map(str, path)) or "(root)"
        if not is_tracked(module):
            raise ValueError(
                f"the embedding collection at {where} has no touched-row marks: call "
                "jaxrec.embedding.track_touched_rows(model) on the trained model (after "
                "sharding it) before init_train_state"
            )
        marks = getattr(module, ATTRIBUTE)
        for t in module.table_configs:
            mask = gathered(marks[t.name].get_value())[: t.num_embeddings]
            out[table_key(path, module, t.name)] = np.flatnonzero(mask).astype(np.int64)
    return out


def _cached(graphdef: nnx.GraphDef, state: TrainState) -> dict[str, bool]:
    """``{table key: whether it is a device cache of a host table}``."""
    model = merge_model(graphdef, state)
    return {
        table_key(path, module, t.name): t.cached_rows is not None
        for path, module in embedding_collections(model)
        for t in module.table_configs
    }


def clear_marks(state: TrainState) -> TrainState:
    """``state`` with every :class:`TouchedRows` zeroed (their arrays are donated)."""

    def clear(v):
        if not isinstance(v, TouchedRows):
            return v
        x = v.get_value()
        return v.replace(_clearer(x.sharding if isinstance(x.sharding, NamedSharding) else None)(x))

    return state._replace(rest=jax.tree.map(clear, state.rest, is_leaf=is_variable))


@functools.cache
def _clearer(sharding: NamedSharding | None):
    """A donating ``zeros_like`` that keeps the marks' sharding (a mesh's) or, on one
    device, their committedness: the train step is not compiled again for them."""
    return jax.jit(jnp.zeros_like, donate_argnums=0, out_shardings=sharding)


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two (at least 8): one compiled gather or scatter
    per bucket, not per delta size."""
    return max(8, 1 << (max(n, 1) - 1).bit_length())


@jax.jit
def _take(x: jax.Array, rows: jax.Array) -> jax.Array:
    return jnp.take(x, rows, axis=0, mode="clip")


def gather_pieces(buf: Buffer, ids: Mapping[str, np.ndarray]) -> list[RowPiece]:
    """The pieces of ``buf``'s marked rows that this process writes (replica 0 of each
    shard), one device gather per shard."""
    array = buf.device_array
    shape = tuple(array.shape)
    two_d = len(shape) == 2
    blocks = Blocks(buf)
    out = []
    for shard in array.addressable_shards:
        if not writes_shard(array, shard):
            continue
        index = tuple(shard.index)
        lo, hi = _span(index, 0, shape[0])
        ca = _span(index, 1, shape[1])[0] if two_d else 0
        found = []  # (table, ids, local rows, local cols c0..c1, logical col)
        for b, r0, r1, c0, c1 in blocks.inside(index, lo, hi):
            if not two_d and b.col != 0:
                continue  # a row-wise field: column pieces hold equal copies
            t_ids = ids[b.table]
            a, z = np.searchsorted(t_ids, [b.row + r0 - b.start, b.row + r1 - b.start])
            if a == z:
                continue
            sel = t_ids[a:z]
            local = sel - b.row + b.start - lo
            found.append((b.table, sel, local, c0 - ca, c1 - ca, b.col + c0 if two_d else 0))
        if not found:
            continue
        rows = np.concatenate([f[2] for f in found]).astype(np.int32)
        padded = np.zeros(bucket(len(rows)), np.int32)
        padded[: len(rows)] = rows
        host = np.asarray(_take(shard.data, padded))[: len(rows)]
        at = 0
        for table, sel, _, c0, c1, col in found:
            part = host[at : at + len(sel)]
            at += len(sel)
            values = np.ascontiguousarray(part[:, c0:c1] if two_d else part)
            out.append(RowPiece(table, sel, col, c1 - c0 if two_d else 0, values))
    return out


def join_pieces(pieces: list[RowPiece], rows: int, dim: int, dtype, what: str) -> LogicalRows:
    """One table field's pieces as whole logical rows (``dim`` 0: a row-wise field).

    Raises:
        ValueError: the pieces do not cover every column of their rows once (a
            damaged or foreign index).
    """
    if not pieces:
        return LogicalRows(np.zeros((0,), np.int64), np.zeros((0, dim) if dim else (0,), dtype))
    ids = np.sort(np.concatenate([p.ids for p in pieces]))  # sorted runs: fast
    ids = ids[np.concatenate(([True], ids[1:] != ids[:-1]))]  # (np.unique hashes: 10x slower)
    if ids.size and (ids[0] < 0 or ids[-1] >= rows):
        raise ValueError(f"{what}: row ids outside [0, {rows})")
    values = np.zeros((len(ids), dim) if dim else (len(ids),), dtype)
    covered = np.zeros(len(ids), np.int64)
    for p in pieces:
        at = np.searchsorted(ids, p.ids)
        if dim:
            values[at, p.col : p.col + p.cols] = p.values
            covered[at] += p.cols
        else:
            values[at] = p.values
            covered[at] += 1
    if not np.all(covered == (dim or 1)):
        raise ValueError(f"{what}: the delta's pieces do not cover each row's columns once")
    return LogicalRows(ids, values)


@functools.partial(jax.jit, donate_argnums=0)
def _merge_2d(x, rows, values, c0, c1):
    old = x.at[rows].get(mode="fill", fill_value=0)
    cols = jnp.arange(x.shape[1])
    keep = (cols >= c0[:, None]) & (cols < c1[:, None])
    return x.at[rows].set(jnp.where(keep, values, old), mode="drop")


@functools.partial(jax.jit, donate_argnums=0)
def _set_rows(x, rows, values):
    return x.at[rows].set(values, mode="drop")


def scatter_rows(buf: Buffer, logical: Mapping[str, LogicalRows]) -> jax.Array | None:
    """``buf.array`` (donated) with the delta's rows of its tables written into every block
    that holds them (any plan); ``None`` when the delta has none of its rows."""
    array = buf.array
    shape = tuple(array.shape)
    two_d = len(shape) == 2
    rows, vals, c0s, c1s = [], [], [], []
    for b in buf.blocks:
        entry = logical.get(b.table)
        if entry is None or not len(entry.ids):
            continue
        a, z = np.searchsorted(entry.ids, [b.row, b.row + b.rows])
        if a == z:
            continue
        rows.append(entry.ids[a:z] - b.row + b.start)
        if two_d:
            part = np.zeros((z - a, shape[1]), entry.values.dtype)
            part[:, : b.cols] = entry.values[a:z, b.col : b.col + b.cols]
            vals.append(part)
            c0s.append(np.zeros(z - a, np.int32))
            c1s.append(np.full(z - a, b.cols, np.int32))
        else:
            vals.append(entry.values[a:z])
    if not rows:
        return None
    n = sum(len(r) for r in rows)
    size = bucket(n)
    r = np.full(size, shape[0], np.int32)  # fill entries fall off the end: dropped
    r[:n] = np.concatenate(rows)
    v = np.zeros((size, *shape[1:]), np.dtype(array.dtype))
    v[:n] = np.concatenate(vals)
    if not two_d or all(len(c) == 0 or c.min() == shape[1] for c in c1s):
        return _set_rows(array, r, v)  # whole rows (every block as wide as the buffer)
    c0 = np.zeros(size, np.int32)
    c1 = np.zeros(size, np.int32)
    c0[:n], c1[:n] = np.concatenate(c0s), np.concatenate(c1s)
    return _merge_2d(array, r, v, c0, c1)


def is_host(buf: Buffer) -> bool:
    """Whether ``buf`` is a field of a host table (``jaxrec.cache``): a numpy array of
    logical rows (``table_buffers(..., host)``), not a device buffer."""
    return buf.where[0] == "host"


def host_pieces(buf: Buffer, ids: Mapping[str, np.ndarray]) -> list[RowPiece]:
    """The piece of a host table field's changed rows that this process writes (the
    rows it holds; none where another process writes them): read from host memory."""
    if not buf.where[3]:  # HostRows.writes
        return []
    (b,) = buf.blocks
    t_ids = ids[b.table]
    a, z = np.searchsorted(t_ids, [b.row, b.row + b.rows])
    if a == z:
        return []
    sel = t_ids[a:z]
    values = np.ascontiguousarray(buf.array[sel - b.row])
    return [RowPiece(b.table, sel, 0, b.cols, values)]


def scatter_host(buf: Buffer, logical: Mapping[str, LogicalRows]) -> None:
    """Writes the delta's rows that a host table field holds (its ``[row, row + rows)``)
    into it, in place (the cache's moves address these arrays)."""
    (b,) = buf.blocks
    entry = logical.get(b.table)
    if entry is None:
        return
    a, z = np.searchsorted(entry.ids, [b.row, b.row + b.rows])
    buf.array[entry.ids[a:z] - b.row] = entry.values[a:z]
