"""Rows between the host tier and the cache slots in a train state's buffers.

A cached table's device table is a table of slots: its weight buffer and optimizer
state fields hold slot ``s`` where the collection's blocks say (any plan; a
column-wise table has one block per column piece). A move gathers the slots being
evicted, then writes the missed rows into their slots in place on the donated
buffers (sizes padded to powers of two, so a run compiles a few programs).

On the CPU, where a device's memory is the host's, a move is one program of C++
calls (``jaxrec_cache_move``) that copy each row once between the host table and
its slot, in place on both: no staging copy, and no rows waiting to be written
back (a later move reads the host after an earlier one wrote it, in program order).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import jax
import numpy as np

from ..checkpoint.layout import Buffer
from ..cpu import available
from ..embedding.blocks import Block
from ..sparse import bucket_capacity
from . import native
from .slots import Move

if TYPE_CHECKING:  # jax exports the class as a variable (jax.Device), not a type
    from jaxlib._jax import Device

HostFields = Mapping[str, Mapping[str, np.ndarray]]  # table key -> field -> host array


class Columns(NamedTuple):
    """One column piece of a table in a buffer: its blocks by first slot."""

    col: int
    cols: int
    rows: np.ndarray  # first slot of each block, sorted
    starts: np.ndarray  # buffer row of each block's first slot
    sizes: np.ndarray

    def positions(self, slots: np.ndarray) -> np.ndarray:
        if len(self.rows) == 1:  # one block (an unsharded table): no search
            lo, hi = self.rows[0], self.rows[0] + self.sizes[0]
            if len(slots) and (slots.min() < lo or slots.max() >= hi):
                raise ValueError("a cache slot is outside its table's blocks")
            return slots + (self.starts[0] - lo)
        i = np.searchsorted(self.rows, slots, side="right") - 1
        if len(slots) and (np.any(i < 0) or np.any(slots - self.rows[i] >= self.sizes[i])):
            raise ValueError("a cache slot is outside its table's blocks")
        return self.starts[i] + slots - self.rows[i]


def columns(blocks: tuple[Block, ...], table: str) -> list[Columns]:
    """The column pieces of ``table`` among ``blocks``."""
    by_col: dict[tuple[int, int], list[Block]] = {}
    for b in blocks:
        if b.table == table:
            by_col.setdefault((b.col, b.cols), []).append(b)
    out = []
    for (col, cols), bs in sorted(by_col.items()):
        bs.sort(key=lambda b: b.row)
        out.append(
            Columns(
                col,
                cols,
                *(
                    np.array(x, np.int64)
                    for x in zip(*[(b.row, b.start, b.rows) for b in bs], strict=True)
                ),
            )
        )
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class MovePaths:
    """How a :class:`Mover` moves rows (the defaults choose by the buffers' devices).

    Attributes:
        inplace: move in place on the CPU (``jaxrec_cache_move``: one C++ copy per row,
            no staging) where it applies; ``False``: always staged.
        pinned: stage the rows in pinned host memory; ``None``: off the CPU (where the
            backend has it), ``True``: also on the CPU (tests, benchmarks).
    """

    inplace: bool = True
    pinned: bool | None = None


class HostWrite(NamedTuple):
    """Evicted rows of one lane on their way to a host field:
    ``host[rows, col:col+cols] = evicted[buffer]``'s rows ``at:at+len(rows)`` on
    ``device``."""

    buffer: int  # index into Mover.buffers
    device: Device  # the lane's device: its shard holds the rows
    host: np.ndarray  # the host field written
    rows: np.ndarray  # [k] int64, rows of ``host`` (this process's)
    at: int  # the first of them in the lane's evicted entries
    col: int  # the column piece: host columns ``col:col+cols``
    cols: int


class LateFill(NamedTuple):
    """Fill rows staged while an earlier batch still evicted them (their value not back
    on the host yet): copied again from ``host`` when the move is applied."""

    buffer: int  # index into Mover.buffers
    lane: int  # the lane whose fill entries they are
    at: int  # the first of the part's fills in the lane's entries
    host: np.ndarray  # the host field read
    rows: np.ndarray  # [k] int64, rows of ``host``: the part's fills
    late: np.ndarray  # [k] bool, the fills whose value was on its way back
    columns: Columns  # the column piece


class InPlacePart(NamedTuple):
    """One column piece of a table in one buffer, moved by one in-place call."""

    buffer: int  # index into Mover.buffers
    key: str  # the table's checkpoint key
    columns: Columns
    evicts: bool  # reads evictions: a row-wise (1-D) field moves with its first piece only


class _LanePart(NamedTuple):
    """A lane's share of one table's column piece in a staged move: fills and evicts as
    indices into the table's :class:`Move` (a slice when all: views, no copies)."""

    key: str
    columns: Columns
    fills: slice | np.ndarray
    fill_pos: np.ndarray  # their buffer rows
    evicts: slice | np.ndarray
    evict_pos: np.ndarray


class Pending(NamedTuple):
    """Evicted rows on their way to host memory (:class:`HostWrite` each)."""

    evicted: list[jax.Array]  # per buffer: each lane's rows on its device
    parts: list[HostWrite]
    keep: tuple[np.ndarray, ...] = ()  # in place: the host arrays the program writes, alive
    # until it ends

    def write_back(self) -> None:
        jax.block_until_ready(self.evicted)  # in place: the program's end
        got: dict[tuple[int, Device], np.ndarray] = {}
        for w in self.parts:
            i, device, host, rows = w.buffer, w.device, w.host, w.rows
            if (i, device) not in got:  # this process's lanes only
                data = [s.data for s in self.evicted[i].addressable_shards if s.device == device]
                got[i, device] = np.asarray(data[0])
            vals = got[i, device][w.at : w.at + len(rows)]
            whole = host.ndim == 1 or (w.col == 0 and w.cols == host.shape[1] == vals.shape[1])
            if whole and native.AVAILABLE and _contiguous(host, vals) and rows.dtype == np.int64:
                native.require().cache_rows(vals, rows, host, True)  # over threads
            elif host.ndim == 1:
                host[rows] = vals
            else:
                host[rows, w.col : w.col + w.cols] = vals[:, : w.cols]


class Lane(NamedTuple):
    """A device's share of a buffer's moves: it holds buffer rows ``[lo, hi)``."""

    device: Device
    lo: int
    hi: int
    first: int  # the first lane holding these rows: it reads them back (replicas only fill)
    local: bool  # a device of this process: its rows are in this process's host arrays


class Mover:
    """Moves rows of the cached tables for the buffers of a state's layout
    (``jaxrec.checkpoint.layout.table_buffers``); ``host[key][field]``: the host arrays
    of each cached table (by checkpoint key); ``names``: their table names; ``paths``:
    the move paths allowed (default: each where it applies)."""

    def __init__(
        self,
        buffers: list[Buffer],
        host: HostFields,
        names: Mapping[str, str] | None = None,
        offsets: Mapping[str, int] | None = None,
        paths: MovePaths = MovePaths(),
    ):
        keys = set(host)
        self.paths = paths
        self.names = dict(names or {})  # checkpoint key -> table name, for messages
        self.offsets = dict(offsets or {})  # checkpoint key -> first logical row held here
        self.buffers = [b for b in buffers if any(x.table in keys for x in b.blocks)]
        self.cols = [{k: columns(b.blocks, k) for k in keys} for b in self.buffers]
        # each device moves the rows of its own buffer rows: no copies between devices
        per_buffer = [lanes(b.device_array.sharding, b.array.shape) for b in self.buffers]
        self.lanes = [x[0] for x in per_buffer]
        self.chunks = [x[1] for x in per_buffer]  # each lane's entries on its device
        self.specs = [x[2] for x in per_buffer]  # (mesh, buffer spec, lane spec), or None
        self.staging = _staging(self.chunks, paths.pinned)
        self._programs: dict = {}
        self.parts = [
            InPlacePart(i, k, c, len(b.array.shape) == 2 or j == 0)
            for i, b in enumerate(self.buffers)
            for k in sorted(keys)
            for j, c in enumerate(self.cols[i][k])
        ]
        self.inplace = (
            paths.inplace
            and self.staging is None
            and not any(self.offsets.values())
            and _inplace(self.buffers, self.parts, host)
        )

    def stage(
        self,
        moves: Mapping[str, Move],
        host: HostFields,
        late: Mapping[str, np.ndarray] | None = None,
    ) -> Staged | InPlace | None:
        """The host side of a move (``None`` when nothing moves): positions, and the
        missed rows gathered from ``host`` (a prefetch can do this while a step runs).
        ``moves[key]``: table ``key``'s :class:`Move`, every device's (with several
        processes, each stages its own devices' lanes from its
        own host rows); ``late[key]``: fill rows whose value is still on its way back
        to the host, copied by :meth:`apply` instead (not on the in-place path)."""
        if self.inplace:
            return self._stage_inplace(moves)
        split, n = [], 0  # per buffer, per lane: its _LanePart's
        for buf, cols, lanes in zip(self.buffers, self.cols, self.lanes, strict=True):
            parts = [[] for _ in lanes]
            row_wise = len(buf.array.shape) == 1
            for key, m in moves.items():
                for k, c in enumerate(cols[key]):
                    pf, pe = c.positions(m.fill_slots), c.positions(m.evict_slots)
                    fl, el = _lane_of(lanes, pf), _lane_of(lanes, pe)  # the first holder
                    for j, lane in enumerate(lanes):  # replicas fill alike; one reads
                        f = _where(fl, lane.first)
                        reads = lane.first == j and (not row_wise or k == 0)  # one copy
                        e = _where(el, j) if reads else slice(0, 0)
                        parts[j].append(_LanePart(key, c, f, pf[f], e, pe[e]))
            for ps in parts:
                n = max(n, sum(len(x.fill_pos) for x in ps), sum(len(x.evict_pos) for x in ps))
            split.append(parts)
        if not n:
            return None
        n = _bucket(n)
        fill_pos, fill_vals, evict_pos, parts_out, patches = [], [], [], [], []
        for i, (buf, lanes, per_lane) in enumerate(
            zip(self.buffers, self.lanes, split, strict=True)
        ):
            shape, dtype = buf.array.shape, buf.array.dtype
            fp, fv, ep = {}, {}, {}
            for j, (lane, items) in enumerate(zip(lanes, per_lane, strict=True)):
                if not lane.local:
                    continue
                pad = lane.hi - lane.lo  # out of the device's rows: dropped / zeros
                fp[j], ep[j] = np.full(n, pad, np.int32), np.full(n, pad, np.int32)
                fv[j] = np.zeros((n, *shape[1:]), dtype)
                f_at = e_at = 0
                for key, c, f, pf, e, pe in items:
                    m = moves[key]
                    src, off = host[key][buf.field], self.offsets.get(key, 0)
                    if len(pf):
                        rows = self._local(key, m.fill_rows[f], off, len(src))
                        fp[j][f_at : f_at + len(pf)] = pf - lane.lo
                        _rows_into(fv[j][f_at : f_at + len(pf)], src, rows, c)
                        if late is not None and late[key][f].any():
                            patches.append(LateFill(i, j, f_at, src, rows, late[key][f], c))
                        f_at += len(pf)
                    if len(pe):
                        ep[j][e_at : e_at + len(pe)] = pe - lane.lo
                        rows = self._local(key, m.evict_rows[e], off, len(src))
                        parts_out.append(HostWrite(i, lane.device, src, rows, e_at, c.col, c.cols))
                        e_at += len(pe)
            fill_pos.append(fp)
            fill_vals.append(fv)
            evict_pos.append(ep)
        patched = {p.buffer for p in patches}
        if self.staging is not None:  # to pinned host memory now (a prefetch's thread)
            fill_vals = [
                v if i in patched else self._global(i, v, n, self.staging[i])
                for i, v in enumerate(fill_vals)
            ]
        return Staged(n, fill_pos, fill_vals, evict_pos, parts_out, patches)

    def _local(self, key: str, rows: np.ndarray, offset: int, held: int) -> np.ndarray:
        """Logical rows as rows of this process's host arrays (which hold rows
        ``[offset, offset + held)``)."""
        local = rows - offset if offset else rows
        if len(local) and (local.min() < 0 or local.max() >= held):
            name = self.names.get(key, key)
            raise ValueError(
                f"host table {name!r} holds rows [{offset}, {offset + held}) in this process, "
                f"and this process's devices cache rows outside them "
                f"({int(rows.min())}..{int(rows.max())}): give it the rows of its devices' "
                "shards (jaxrec.cache.host_rows)"
            )
        return local

    def _global(
        self, i: int, chunks: Mapping[int, np.ndarray], n: int, sharding: jax.sharding.Sharding
    ) -> jax.Array:
        """One array of every lane's ``n`` entries from this process's lanes' chunks."""
        lanes = self.lanes[i]
        shape = (n * len(lanes), *next(iter(chunks.values())).shape[1:])
        kind = sharding.memory_kind
        arrays = [
            jax.device_put(
                chunks[j], jax.sharding.SingleDeviceSharding(lanes[j].device, memory_kind=kind)
            )
            for j in sorted(chunks)
        ]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    def _stage_inplace(self, moves: Mapping[str, Move]) -> InPlace | None:
        n = max(
            [
                0,
                *(
                    max(len(moves[p.key].fill_slots), len(moves[p.key].evict_slots))
                    for p in self.parts
                ),
            ]
        )
        if not n:
            return None
        n = _bucket(n)
        out = InPlace(
            *(np.full((len(self.parts), n), -1, np.int32) for _ in range(2)),
            *(np.zeros((len(self.parts), n), np.int64) for _ in range(2)),
        )
        for j, p in enumerate(self.parts):
            m = moves[p.key]
            out.fill_pos[j, : len(m.fill_slots)] = p.columns.positions(m.fill_slots)
            out.fill_rows[j, : len(m.fill_rows)] = m.fill_rows
            if p.evicts:
                out.evict_pos[j, : len(m.evict_slots)] = p.columns.positions(m.evict_slots)
                out.evict_rows[j, : len(m.evict_rows)] = m.evict_rows
        return out

    def check_host(self, host: HostFields) -> None:
        """In place, the kernel reads whole rows at each host array's address: every
        one must still be contiguous (a field replaced rather than filled may not be)."""
        for p in self.parts if self.inplace else ():
            field = self.buffers[p.buffer].field
            if not host[p.key][field].flags.c_contiguous:
                name = self.names.get(p.key, p.key)
                raise ValueError(
                    f"host table {name!r} field {field!r} was replaced by a "
                    "non-contiguous array; fill it in place"
                )

    def _apply_inplace(
        self, arrays: Sequence[jax.Array], staged: InPlace, host: HostFields | None
    ) -> tuple[list[jax.Array], Pending]:
        if host is None:
            raise ValueError("an in-place move needs the host arrays (Mover.apply's host)")
        self.check_host(host)
        attrs, keep = [], []
        for p in self.parts:
            h, c = host[p.key][self.buffers[p.buffer].field], p.columns
            keep.append(h)
            wide = h.ndim == 2
            attrs.append(
                (
                    p.buffer,
                    h.ctypes.data,
                    len(h),
                    h.strides[0],
                    c.col * h.itemsize if wide else 0,
                    (c.cols if wide else 1) * h.itemsize,
                )
            )
        attrs = tuple(attrs)
        if attrs not in self._programs:  # the host arrays' addresses are in the program
            self._programs = {
                attrs: jax.jit(functools.partial(_move_inplace, attrs), donate_argnums=0)
            }
        pos_e, pos_f, rows_e, rows_f = staged  # int64 rows as int32 pairs (no x64 needed)
        new, done = self._programs[attrs](
            list(arrays), pos_e, pos_f, rows_e.view(np.int32), rows_f.view(np.int32)
        )
        return new, Pending(done, [], tuple(keep))

    def apply(
        self, arrays: list[jax.Array], staged: Staged | InPlace, host: HostFields | None = None
    ) -> tuple[list[jax.Array], Pending]:
        """Runs a staged move on the buffers ``arrays`` (donated): the evicted rows are
        read, then the missed rows written. Returns the new buffers and the evicted rows
        (not yet on the host: :meth:`Pending.write_back`; in place: written by the
        program, whose end ``write_back`` waits for). ``host``: the in-place path's
        host arrays."""
        if isinstance(staged, InPlace):
            return self._apply_inplace(arrays, staged, host)
        fill_vals = list(staged.fill_vals)
        for p in staged.patches:  # their rows are back on the host
            where = np.flatnonzero(p.late)
            fv, vals = fill_vals[p.buffer][p.lane], _columns(p.host, p.rows[where], p.columns)
            if fv.ndim == 1:
                fv[p.at + where] = vals
            else:
                fv[p.at + where, : p.columns.cols] = vals
        kinds = self.staging or self.chunks
        fill_vals = [
            v if isinstance(v, jax.Array) else self._global(i, v, staged.n, kinds[i])
            for i, v in enumerate(fill_vals)
        ]
        fill_pos, evict_pos = (
            [self._global(i, p, staged.n, self.chunks[i]) for i, p in enumerate(pos)]
            for pos in (staged.fill_pos, staged.evict_pos)
        )
        self._make_programs(arrays)
        # two programs: in one, XLA copies each whole buffer to scatter in place after
        # the gather read it; the runtime orders the donation after the read instead
        evicted = self._programs["gather"](list(arrays), evict_pos)
        new = self._programs["scatter"](list(arrays), fill_pos, fill_vals)
        return new, Pending(evicted, staged.parts)

    def _make_programs(self, arrays: Sequence[jax.Array]) -> None:
        if not self._programs:
            specs, kinds = tuple(self.specs), self.staging or self.chunks
            self._programs = {
                "gather": jax.jit(functools.partial(_gather, specs), out_shardings=kinds),
                "scatter": jax.jit(
                    functools.partial(_scatter, specs, self.staging and self.chunks),
                    donate_argnums=0,
                    out_shardings=[a.sharding for a in arrays],
                ),
            }

    def copy_out(
        self, arrays: list[jax.Array], staged: Staged | InPlace, host: HostFields
    ) -> Pending:
        """The evictions of a move without fills (a flush) on their way to the host,
        reading the buffers ``arrays`` without taking them: nothing is donated, so the
        state they belong to stays valid. In place, the rows are copied now, from the
        buffers' memory (the CPU's: read where it lies, once every program that writes
        the buffers has ended)."""
        if not isinstance(staged, InPlace):
            self._make_programs(arrays)
            evict_pos = [
                self._global(i, p, staged.n, self.chunks[i]) for i, p in enumerate(staged.evict_pos)
            ]
            return Pending(self._programs["gather"](list(arrays), evict_pos), staged.parts)
        self.check_host(host)
        jax.block_until_ready(arrays)
        for j, p in enumerate(self.parts):
            at, c = staged.evict_pos[j], p.columns
            keep = at >= 0 if p.evicts else np.zeros(len(at), bool)
            if not keep.any():
                continue
            at, rows = at[keep], staged.evict_rows[j][keep]
            src, h = np.asarray(arrays[p.buffer]), host[p.key][self.buffers[p.buffer].field]
            if h.ndim == 1:
                h[rows] = src[at]
            else:
                h[rows, c.col : c.col + c.cols] = src[at, : c.cols]
        return Pending([], [])


class InPlace(NamedTuple):
    """An in-place move (see :meth:`Mover.stage`): per part, padded with position -1."""

    evict_pos: np.ndarray  # [parts, n] int32
    fill_pos: np.ndarray
    evict_rows: np.ndarray  # [parts, n] int64 (host rows)
    fill_rows: np.ndarray


class Staged(NamedTuple):
    """A move ready to run (see :meth:`Mover.stage`): per buffer, ``n`` entries a lane,
    this process's lanes by lane index (numpy, or one array once staged)."""

    n: int
    fill_pos: list[dict[int, np.ndarray]]  # lane positions: rows of its device's block
    fill_vals: list[dict[int, np.ndarray] | jax.Array]  # one array once staged
    evict_pos: list[dict[int, np.ndarray]]
    parts: list[HostWrite]  # the evictions' writes, as Pending.parts
    patches: list[LateFill]


def _contiguous(*arrays: np.ndarray) -> bool:
    """C-contiguous arrays of a plain numpy dtype (the C++ copy takes their buffers)."""
    return all(a.flags.c_contiguous and a.dtype.kind in "fiub" for a in arrays)


def _columns(src: np.ndarray, rows: np.ndarray, c: Columns) -> np.ndarray:
    return src[rows] if src.ndim == 1 else src[rows, c.col : c.col + c.cols]


def _rows_into(out: np.ndarray, src: np.ndarray, rows: np.ndarray, c: Columns) -> None:
    """Host rows ``rows`` (the columns of piece ``c``) into ``out``, one copy."""
    whole = src.ndim == 1 or (c.col == 0 and c.cols == src.shape[1] == out.shape[1])
    if whole and native.AVAILABLE and _contiguous(src, out) and rows.dtype == np.int64:
        native.require().cache_rows(src, rows, out, False)  # over threads
    elif src.ndim == 1:
        np.take(src, rows, out=out)
    elif c.col == 0 and c.cols == src.shape[1] == out.shape[1]:
        np.take(src, rows, axis=0, out=out)
    else:
        out[:, : c.cols] = _columns(src, rows, c)


def _gather(specs, arrays, evict_pos):
    def read(a, e):
        return a.at[e].get(mode="fill", fill_value=0)

    return [_on_lanes(s, read, 1)(a, e) for s, a, e in zip(specs, arrays, evict_pos, strict=True)]


def _scatter(specs, to_device, arrays, fill_pos, fill_vals):
    if to_device is not None:  # staged in pinned host memory: copied in by the program
        fill_vals = [jax.device_put(v, s) for v, s in zip(fill_vals, to_device, strict=True)]

    def write(a, p, v):
        return a.at[p].set(v, mode="drop")

    return [
        _on_lanes(s, write, 2, out=0)(a, p, v)
        for s, a, p, v in zip(specs, arrays, fill_pos, fill_vals, strict=True)
    ]


def _on_lanes(spec, fn, lane_args: int, out: int | None = None):
    """``fn(buffer block, *lane entries)`` on each device (its own rows: nothing crosses
    between devices); ``out=0``: it returns the block, else lane entries."""
    if spec is None:  # one device
        return fn
    mesh, buffer, lane = spec
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(buffer, *[lane] * lane_args),
        out_specs=buffer if out == 0 else lane,
        check_vma=False,
    )


def lanes(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> tuple[list[Lane], jax.sharding.Sharding, tuple | None]:
    """A buffer's lanes (its devices, in the order of their moves' entries), the sharding
    that gives each lane's entries to its device, and the ``shard_map`` specs."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        chunk = jax.sharding.NamedSharding(mesh, jax.P(tuple(mesh.axis_names)))
        at = chunk.devices_indices_map((mesh.size,))
        devices = sorted(at, key=lambda d: at[d][0].start)
        spec = (mesh, sharding.spec, chunk.spec)
    elif len(sharding.device_set) == 1:
        devices, spec = list(sharding.device_set), None
        chunk = jax.sharding.SingleDeviceSharding(devices[0])
    else:
        raise ValueError(
            f"a cached table's buffer has sharding {sharding}: expected a "
            "NamedSharding (a plan over a mesh) or one device"
        )
    index = sharding.devices_indices_map(shape)
    lanes, first, me = [], {}, jax.process_index()
    for j, dev in enumerate(devices):
        rows, *rest = index[dev]
        if any(s != slice(None) for s in rest):
            raise ValueError("a cached table's buffer is split by columns across devices")
        lo, hi, _ = rows.indices(shape[0])
        lanes.append(Lane(dev, lo, hi, first.setdefault((lo, hi), j), dev.process_index == me))
    return lanes, chunk, spec


def _where(lane_of: np.ndarray | int, j: int) -> slice | np.ndarray:
    """The entries of lane ``j``: a slice when every entry is (one lane)."""
    if isinstance(lane_of, int):
        return slice(None) if lane_of == j else slice(0, 0)
    return np.flatnonzero(lane_of == j)


def _lane_of(lanes: list[Lane], positions: np.ndarray) -> np.ndarray | int:
    """The first lane holding each buffer row in ``positions`` (an int: all in one)."""
    firsts = sorted({x.first for x in lanes}, key=lambda j: lanes[j].lo)
    if len(firsts) == 1:
        return firsts[0]
    los = np.array([lanes[j].lo for j in firsts])
    return np.array(firsts)[np.searchsorted(los, positions, side="right") - 1]


def _move_inplace(attrs, arrays, evict_pos, fill_pos, evict_rows, fill_rows):
    arrays = list(arrays)
    for j, (i, host, rows, stride, offset, nbytes) in enumerate(attrs):
        a = arrays[i]
        call = jax.ffi.ffi_call(
            "jaxrec_cache_move", jax.ShapeDtypeStruct(a.shape, a.dtype), input_output_aliases={0: 0}
        )
        arrays[i] = call(
            a,
            evict_pos[j],
            evict_rows[j],
            fill_pos[j],
            fill_rows[j],
            host=np.int64(host),
            host_rows=np.int64(rows),
            host_stride=np.int64(stride),
            host_offset=np.int64(offset),
            nbytes=np.int64(nbytes),
        )
    # a few bytes computed after the calls: waiting for them waits for the host writes
    return arrays, [a.reshape(-1)[:1] for a in arrays]


def _inplace(buffers: list[Buffer], parts: list[InPlacePart], host: HostFields) -> bool:
    """Whether moves can run in place (``jaxrec_cache_move``): the C++ kernels
    registered, every buffer on one CPU device, the host arrays contiguous, of the
    buffer's dtype and row shape."""
    if not buffers or jax.process_count() > 1:
        return False
    for p in parts:
        b, c = buffers[p.buffer], p.columns
        h = host[p.key][b.field]
        devs = b.device_array.sharding.device_set
        ok = (
            len(devs) == 1
            and next(iter(devs)).platform == "cpu"
            and h.flags.c_contiguous
            and h.dtype == b.array.dtype
            and h.ndim == len(b.array.shape)
            and (h.ndim == 1 or c.col + c.cols <= h.shape[1] and c.cols <= b.array.shape[1])
        )
        if not ok:
            return False
    return available()  # the FFI target registered (the CPU backend, the extension)


def _staging(
    chunks: list[jax.sharding.Sharding], pinned: bool | None
) -> list[jax.sharding.Sharding] | None:
    """Pinned-host shardings for the moves' rows, or None (the CPU, where host and
    device memory are one, or a backend without pinned host memory). Each device's
    rows are its own lane (``lanes``): it copies them across over its own link, and
    the host stages one copy of each row. ``pinned``: as ``MovePaths.pinned``."""
    if not chunks:
        return None
    dev = next(iter(chunks[0].device_set))
    use = pinned if pinned is not None else dev.platform != "cpu"
    if not use or "pinned_host" not in {m.kind for m in dev.addressable_memories()}:
        return None
    return [s.with_memory_kind("pinned_host") for s in chunks]


def _bucket(n: int) -> int:
    """Padded move sizes, so a run compiles a few programs: powers of two and 1.5x
    powers of two from 256 (a staged move copies its padding across: at most a third
    of it, where powers of two alone padded up to half)."""
    return bucket_capacity(n, minimum=256)
