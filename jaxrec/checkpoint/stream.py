"""Table buffers to and from disk a bounded slice at a time, each process its own shards.

Saving: every shard a process holds (replica 0) is cut along its blocks into
pieces, rectangles of one table's field in logical coordinates; each piece is
one array on disk (``store.py``). Rows go from device to host ``staging_bytes``
at a time, a window of whole chunks. Restoring: each device's shard of the
target buffer is filled in place, a window of rows at a time, from the pieces
that overlap it, so any plan and device count reads only the rows it needs.
"""

from __future__ import annotations

import bisect
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, NamedTuple

import jax
import numpy as np
import tensorstore as ts
from jax import lax

from ..embedding.blocks import Block
from . import store
from .layout import Buffer

if TYPE_CHECKING:  # jax exports the class as a variable (jax.Device), not a type
    from jaxlib._jax import Device

STAGING_BYTES = 64 << 20
Index = tuple[slice, ...]  # a shard's place in its global array
Rows = Callable[[int, int], np.ndarray]  # (start, n) -> host rows [start, start + n)


class Piece(NamedTuple):
    """Rows ``[row, row + rows)``, columns ``[col, col + cols)`` of a table field
    (``cols`` 0: a row-wise field), stored in chunks of ``chunk_rows``."""

    row: int
    rows: int
    col: int
    cols: int
    chunk_rows: int


def piece_path(root: str, table_id: int, field: str, p: Piece) -> str:
    return os.path.join(root, "tables", str(table_id), field, f"{p.row}_{p.col}")


def _span(index: Index, dim: int, size: int) -> tuple[int, int]:
    if dim >= len(index):
        return 0, size
    s = index[dim]
    return s.start or 0, size if s.stop is None else s.stop


class Blocks:
    """A buffer's blocks sorted by their first row: those inside a window are found by
    bisection (a buffer of a production model has tens of thousands of blocks)."""

    def __init__(self, buf: Buffer):
        self.blocks = sorted(buf.blocks, key=lambda b: b.start)
        self.ends = [b.start + b.rows for b in self.blocks]
        if any(e > b.start for e, b in zip(self.ends, self.blocks[1:], strict=False)):
            raise ValueError(f"blocks of buffer {'/'.join(map(str, buf.where))} overlap")
        self.shape = tuple(buf.array.shape)

    def inside(self, index: Index, lo: int, hi: int) -> Iterator[tuple[Block, int, int, int, int]]:
        """``(block, physical rows [r0, r1), physical cols [c0, c1))`` of the blocks inside
        rows ``[lo, hi)`` and the columns of shard ``index``."""
        two_d = len(self.shape) == 2
        ca, cb = _span(index, 1, self.shape[1]) if two_d else (0, 0)
        for i in range(bisect.bisect_right(self.ends, lo), len(self.blocks)):
            b = self.blocks[i]
            if b.start >= hi:
                break
            r0, r1 = max(b.start, lo), min(b.start + b.rows, hi)
            c0, c1 = (max(0, ca), min(b.cols, cb)) if two_d else (0, 0)
            if r0 < r1 and (not two_d or c0 < c1):
                yield b, r0, r1, c0, c1


def _window(rows: int, row_bytes: int, staging_bytes: int, at_least: int = 1) -> int:
    return min(rows, max(at_least, staging_bytes // max(row_bytes, 1)))


@functools.partial(jax.jit, static_argnums=2)
def _rows(x: jax.Array, start, n: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, start, n, 0)


@functools.partial(jax.jit, donate_argnums=0)
def _put_rows(x: jax.Array, rows: jax.Array, start) -> jax.Array:
    return lax.dynamic_update_slice_in_dim(x, rows, start, 0)


def writes_shard(array: jax.Array, shard: jax.Shard) -> bool:
    """Whether this process writes ``shard``: replica 0 of a global array; a
    process-local array only from process 0 (every process holds its own)."""
    if shard.replica_id != 0:
        return False
    return jax.process_count() == 1 or not array.is_fully_addressable or jax.process_index() == 0


class ShardSource(NamedTuple):
    """One shard to write: its global index and a reader of row windows."""

    index: Index
    shape: tuple[int, ...]
    rows: Rows  # (start, n) -> host rows


def shard_sources(
    buf: Buffer, snapshot: bool, staging_bytes: int = STAGING_BYTES, *, host_views: bool = True
) -> list[ShardSource]:
    """The shards of ``buf`` this process writes, read from the device a window at a
    time while writing, or, with ``snapshot`` (an asynchronous save: the caller may
    donate the array at once), copied to host now: only the rows of its pieces, not a
    padded layout's padding, through one staging window. ``host_views``: read a CPU
    device's shards through zero-copy views of its memory (``False``: sliced on the
    device and copied a window at a time, as off the CPU)."""
    array, out = buf.array, []
    if isinstance(array, np.ndarray):  # a host table (jaxrec.cache): read in place
        if not buf.where[3]:  # another process writes these rows
            return []
        if snapshot:
            raise ValueError("a host table is written in place by training: save it synchronously")
        table = array
        index = tuple(slice(0, n) for n in table.shape)
        return [ShardSource(index, table.shape, lambda s, n: table[s : s + n])]
    for shard in array.addressable_shards:
        if not writes_shard(array, shard):
            continue
        index: Index = tuple(shard.index)
        data: jax.Array = shard.data
        read = _reader(data, host_views and shard.device.platform == "cpu")
        if snapshot:
            read = _snapshot(buf, index, data, read, staging_bytes)
        out.append(ShardSource(index, data.shape, read))
    return out


def _reader(data: jax.Array, view: bool) -> Rows:
    """Rows ``[s, s + n)`` of a shard on the host: a view of a CPU device's memory (no
    copy), else a window sliced on the device and copied."""
    if view:
        host = np.asarray(data)
        return lambda s, n: host[s : s + n]
    return lambda s, n: np.asarray(_rows(data, s, n))


def _snapshot(buf: Buffer, index: Index, data: jax.Array, read: Rows, staging_bytes: int) -> Rows:
    """A host copy of the rows of ``buf``'s blocks in one shard, and its window reader
    (rows outside the blocks read as zeros: no piece holds them)."""
    shape, local = tuple(buf.array.shape), data.shape
    lo, hi = _span(index, 0, shape[0])
    spans = sorted({(r0 - lo, r1 - lo) for _, r0, r1, _, _ in Blocks(buf).inside(index, lo, hi)})
    starts = np.cumsum([0] + [e - s for s, e in spans])
    copy = np.empty((int(starts[-1]), *local[1:]), data.dtype)
    row_bytes = int(np.prod(local[1:], dtype=np.int64)) * data.dtype.itemsize
    n = _window(local[0], row_bytes, staging_bytes)
    for w0 in range(0, local[0], max(n, 1)):
        w0 = min(w0, local[0] - n)
        window: np.ndarray | None = None
        for (s, e), at in zip(spans, starts, strict=False):
            a, b = max(s, w0), min(e, w0 + n)
            if a < b:
                window = read(w0, n) if window is None else window
                copy[at + a - s : at + b - s] = window[a - w0 : b - w0]

    def rows(w0: int, n: int) -> np.ndarray:
        out = np.zeros((n, *local[1:]), data.dtype)
        for (s, e), at in zip(spans, starts, strict=False):
            a, b = max(s, w0), min(e, w0 + n)
            if a < b:
                out[a - w0 : b - w0] = copy[at + a - s : at + b - s]
        return out

    return rows


def save_buffer(
    root: str,
    buf: Buffer,
    sources: list[ShardSource],
    table_ids: Mapping[str, int],
    staging_bytes: int = STAGING_BYTES,
) -> dict[str, list[Piece]]:
    """Writes this process's pieces of ``buf``; returns ``{table: [Piece]}``."""
    shape, dtype = tuple(buf.array.shape), np.dtype(buf.array.dtype)
    blocks = Blocks(buf)
    written: dict[str, list[Piece]] = {}
    for src in sources:
        lo, hi = _span(src.index, 0, shape[0])
        if hi <= lo:
            continue
        row_bytes = int(np.prod(src.shape[1:], dtype=np.int64)) * dtype.itemsize
        cr = store.row_chunks(src.shape, dtype)[0]
        ca = _span(src.index, 1, shape[1])[0] if len(shape) == 2 else 0
        found: list[tuple[str, Piece, int, int]] = []  # (table, piece, first shard row, shard col)
        for b, r0, r1, c0, c1 in blocks.inside(src.index, lo, hi):
            if len(shape) == 1 and b.col != 0:
                continue  # a row-wise field: column pieces hold equal copies
            rows = r1 - r0  # chunks of at most cr rows, equal sizes: zarr pads the last one
            p = Piece(
                b.row + r0 - b.start,
                rows,
                b.col + c0 if c1 else 0,
                c1 - c0,
                -(-rows // -(-rows // cr)),
            )
            found.append((b.table, p, r0 - lo, c0 - ca))
            written.setdefault(b.table, []).append(p)
        arrays = store.create(
            [
                (
                    piece_path(root, table_ids[t], buf.field, p),
                    _dims(p),
                    dtype,
                    (p.chunk_rows, *_dims(p)[1:]),
                )
                for t, p, _, _ in found
            ]
        )
        chunks = []  # (first shard row, rows, array, piece row offset, shard col, cols)
        for (_, p, first, col), arr in zip(found, arrays, strict=True):
            for k in range(0, p.rows, p.chunk_rows):
                chunks.append((first + k, min(p.chunk_rows, p.rows - k), arr, k, col, p.cols))
        chunks.sort(key=lambda c: c[0])
        n = _window(hi - lo, row_bytes, staging_bytes, cr)
        i = 0
        while i < len(chunks):
            w0 = min(chunks[i][0], hi - lo - n)
            j = i
            while j < len(chunks) and chunks[j][0] + chunks[j][1] <= w0 + n:
                j += 1
            host = src.rows(w0, n)
            futures = []
            for first, rows, arr, k, col, cols in chunks[i:j]:
                part = host[first - w0 : first - w0 + rows]
                part = part[:, col : col + cols] if len(shape) == 2 else part
                futures.append(store.write(arr, slice(k, k + rows), part))
            for f in futures:
                f.result()
            i = j
    return written


def restore_buffer(
    root: str,
    buf: Buffer,
    pieces: Mapping[str, list[Piece]],
    table_ids: Mapping[str, int],
    what: str,
    staging_bytes: int = STAGING_BYTES,
) -> jax.Array | np.ndarray:
    """A new array shaped and sharded like ``buf.array``, filled from the saved pieces
    (a host table, a numpy array, is filled in place)."""
    target = buf.array
    shape, dtype = tuple(target.shape), np.dtype(target.dtype)
    blocks = Blocks(buf)
    by_index: dict[tuple[tuple[int, int], ...], list[Device]] = {}  # spans -> their devices
    if isinstance(target, np.ndarray):
        by_index[_normal((), shape)] = []
    else:
        for device, index in target.sharding.addressable_devices_indices_map(shape).items():
            by_index.setdefault(_normal(index or (), shape), []).append(device)
    # the pieces this process's shards read (an ordered set), opened at once
    needed: dict[tuple[str, Piece], None] = {}
    for spans in by_index:
        index = tuple(slice(a, b) for a, b in spans)
        for b, r0, r1, _, _ in blocks.inside(index, spans[0][0], spans[0][1]):
            lr0, lr1 = b.row + r0 - b.start, b.row + r1 - b.start
            for p in pieces.get(b.table, ()):
                if max(lr0, p.row) < min(lr1, p.row + p.rows):
                    needed[(b.table, p)] = None
    opened = _open(root, buf.field, needed, table_ids, dtype, what)

    def fill(host: np.ndarray, g0: int, index: Index) -> None:
        """Writes the window's rows into ``host`` (TensorStore copies straight into it)."""
        host.fill(0)  # padding rows and columns
        into = ts.array(host, copy=False, write=True)
        ca = _span(index, 1, shape[1])[0] if len(shape) == 2 else 0
        reads = []
        for b, r0, r1, c0, c1 in blocks.inside(index, g0, g0 + host.shape[0]):
            lr0, lr1 = b.row + r0 - b.start, b.row + r1 - b.start
            lc0, lc1 = b.col + c0, b.col + c1
            covered = 0
            for p in pieces.get(b.table, ()):
                pr0, pr1 = max(lr0, p.row), min(lr1, p.row + p.rows)
                pc0, pc1 = (max(lc0, p.col), min(lc1, p.col + p.cols)) if p.cols else (0, 0)
                if pr0 >= pr1 or (p.cols and pc0 >= pc1):
                    continue
                src = (slice(pr0 - p.row, pr1 - p.row),)
                dst = (slice(r0 + pr0 - lr0 - g0, r0 + pr1 - lr0 - g0),)
                if len(shape) == 2:
                    src += (slice(pc0 - p.col, pc1 - p.col),)
                    dst += (slice(c0 + pc0 - lc0 - ca, c0 + pc1 - lc0 - ca),)
                reads.append((into[dst].write(opened[(b.table, p)][src]), b.table))
                covered += (pr1 - pr0) * ((pc1 - pc0) if len(shape) == 2 else 1)
            want = (lr1 - lr0) * ((lc1 - lc0) if len(shape) == 2 else 1)
            if covered != want:
                raise store.CheckpointCorruptError(
                    f"{what}: rows {lr0}..{lr1 - 1} of table {b.table!r} field {buf.field!r} are "
                    "not all in the checkpoint's index (pieces missing or overlapping)"
                )
        for future, table in reads:
            try:
                future.result()
            except Exception as e:  # noqa: BLE001  (TensorStore raises ValueError)
                raise store.CheckpointCorruptError(
                    f"{what}: table {table!r} field {buf.field!r}: {store.short(e)}"
                ) from None

    if isinstance(target, np.ndarray):  # a host table: filled in place, a window at a time
        index = tuple(slice(0, n) for n in shape)
        n = _window(
            shape[0], int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize, staging_bytes
        )
        for w0 in range(0, shape[0], max(n, 1)):
            fill(target[w0 : w0 + n], w0, index)
        return target
    arrays = []
    for spans, group in by_index.items():
        index = tuple(slice(a, b) for a, b in spans)
        local = tuple(b - a for a, b in spans)
        row_bytes = int(np.prod(local[1:], dtype=np.int64)) * dtype.itemsize
        outs = [jax.numpy.zeros(local, dtype, device=d) for d in group]
        n = _window(local[0], row_bytes, staging_bytes)
        host = np.empty((n, *local[1:]), dtype)  # one staging window, reused
        for w0 in range(0, local[0], max(n, 1)):
            w0 = min(w0, local[0] - n)
            fill(host, spans[0][0] + w0, index)
            outs = [
                _put_rows(o, jax.device_put(host, d), w0) for o, d in zip(outs, group, strict=True)
            ]
            jax.block_until_ready(outs)  # before the window is refilled (device_put may alias it)
        arrays.extend(outs)
    return jax.make_array_from_single_device_arrays(shape, target.sharding, arrays)


def _normal(index: Index, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(_span(index, d, shape[d]) for d in range(len(shape)))


def _dims(p: Piece) -> tuple[int, ...]:
    return (p.rows, p.cols) if p.cols else (p.rows,)


def _open(
    root: str,
    field: str,
    keys: Iterable[tuple[str, Piece]],
    table_ids: Mapping[str, int],
    dtype: np.dtype,
    what: str,
) -> dict[tuple[str, Piece], ts.TensorStore]:
    """``{(table, Piece): array}`` of pieces ``keys``, opened concurrently."""
    by_table: dict[str, list[Piece]] = {}
    for table, p in keys:
        by_table.setdefault(table, []).append(p)
    out = {}
    for table, ps in by_table.items():
        items = [
            (
                piece_path(root, table_ids[table], field, p),
                _dims(p),
                dtype,
                (p.chunk_rows, *_dims(p)[1:]),
            )
            for p in ps
        ]
        name = f"{what}: table {table!r} field {field!r}"
        out.update(zip([(table, p) for p in ps], store.open_arrays(items, name), strict=True))
    return out
