"""Rows between the host tier and the cache slots in a train state's buffers.

A cached table's device table is a table of slots: its weight buffer and optimizer
state fields hold slot ``s`` where the collection's blocks say (any plan; a
column-wise table has one block per column piece). A move gathers the slots being
evicted and then writes the missed rows into their slots, in one jitted program per
set of shapes, in place on the donated buffers.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax
import numpy as np

from ..checkpoint.layout import Buffer
from ..embedding.blocks import Block


class Columns(NamedTuple):
    """One column piece of a table in a buffer: its blocks by first slot."""

    col: int
    cols: int
    rows: np.ndarray  # first slot of each block, sorted
    starts: np.ndarray  # buffer row of each block's first slot
    sizes: np.ndarray

    def positions(self, slots: np.ndarray) -> np.ndarray:
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
        out.append(Columns(col, cols, *(np.array(x, np.int64) for x in zip(
            *[(b.row, b.start, b.rows) for b in bs], strict=True))))  # fmt: skip
    return out


class Pending(NamedTuple):
    """Evicted rows on their way to host memory: ``host[rows, col:col+cols] =
    evicted[at:at+len(rows), :cols]`` for each part."""

    evicted: list[jax.Array]  # per buffer
    parts: list[tuple[int, np.ndarray, np.ndarray, int, int, int]]  # buf, host, rows, at, col, cols

    def write_back(self) -> None:
        host_vals = [np.asarray(e) for e in self.evicted]
        for i, host, rows, at, col, cols in self.parts:
            vals = host_vals[i][at : at + len(rows)]
            if host.ndim == 2:
                host[rows, col : col + cols] = vals[:, :cols]
            else:
                host[rows] = vals


class Mover:
    """Moves rows of the cached tables ``keys`` (checkpoint keys) for the buffers of a
    state's layout (``jaxrec.checkpoint.layout.table_buffers``)."""

    def __init__(self, buffers: list[Buffer], keys: set[str]):
        self.buffers = [b for b in buffers if any(x.table in keys for x in b.blocks)]
        self.cols = [{k: columns(b.blocks, k) for k in keys} for b in self.buffers]
        self._programs: dict = {}

    def move(
        self,
        arrays: list[jax.Array],
        moves: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
        host: Mapping[str, Mapping[str, np.ndarray]],
    ) -> tuple[list[jax.Array], Pending]:
        """``moves[key] = (fill_slots, fill_rows, evict_slots, evict_rows)``; ``host[key]``
        the table's host fields. Returns the new buffers and the evicted rows (not yet
        on the host: :meth:`Pending.write_back`)."""
        fill_pos, fill_vals, evict_pos, parts = [], [], [], []
        for i, (buf, cols) in enumerate(zip(self.buffers, self.cols, strict=True)):
            width = buf.array.shape[1] if buf.array.ndim == 2 else 0
            fp, fv, ep, at = [], [], [], 0
            for key, (fs, fr, es, er) in moves.items():
                src = host[key][buf.field]
                for k, c in enumerate(cols[key]):
                    if len(fs):
                        fp.append(c.positions(fs))
                        vals = src[fr, c.col : c.col + c.cols] if width else src[fr]
                        fv.append(_pad(vals, width))
                    if len(es) and (width or k == 0):  # a row-wise field: one copy suffices
                        ep.append(c.positions(es))
                        parts.append((i, src, er, at, c.col, c.cols))
                        at += len(es)
            fill_pos.append(_cat(fp, np.int64))
            fill_vals.append(np.concatenate(fv) if fv else np.zeros((0, *buf.array.shape[1:]),
                                                                   buf.array.dtype))  # fmt: skip
            evict_pos.append(_cat(ep, np.int64))
        return self._run(arrays, fill_pos, fill_vals, evict_pos, parts)

    def _run(self, arrays, fill_pos, fill_vals, evict_pos, parts):
        nf = _bucket(max(len(p) for p in fill_pos))
        ne = _bucket(max(len(p) for p in evict_pos))
        fp, fv, ep = [], [], []
        for a, p, v, e in zip(arrays, fill_pos, fill_vals, evict_pos, strict=True):
            n = a.shape[0]  # padding positions: out of range (dropped / read as zeros)
            fp.append(np.pad(p, (0, nf - len(p)), constant_values=n).astype(np.int32))
            fv.append(np.pad(v, [(0, nf - len(v))] + [(0, 0)] * (v.ndim - 1)).astype(a.dtype))
            ep.append(np.pad(e, (0, ne - len(e)), constant_values=n).astype(np.int32))
        key = (nf, ne)
        if key not in self._programs:
            shardings = [a.sharding for a in arrays]
            self._programs[key] = jax.jit(_move, donate_argnums=0, out_shardings=(shardings, None))
        new, evicted = self._programs[key](list(arrays), ep, fp, fv)
        return new, Pending(evicted, parts)


def _move(arrays, evict_pos, fill_pos, fill_vals):
    """Reads the evicted slots, then writes the filled ones (the same slot may be both)."""
    evicted = [
        a.at[e].get(mode="fill", fill_value=0) for a, e in zip(arrays, evict_pos, strict=True)
    ]
    new = [a.at[p].set(v, mode="drop") for a, p, v in zip(arrays, fill_pos, fill_vals, strict=True)]
    return new, evicted


def _pad(rows: np.ndarray, width: int) -> np.ndarray:
    if not width or rows.shape[1] == width:
        return rows
    return np.pad(rows, [(0, 0), (0, width - rows.shape[1])])


def _cat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


@functools.cache
def _bucket(n: int) -> int:
    """Padded move sizes, powers of two from 256, so a run compiles a few programs."""
    return max(256, 1 << max(0, n - 1).bit_length())
