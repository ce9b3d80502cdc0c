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
            if host.ndim == 1:
                host[rows] = vals
            elif col == 0 and cols == host.shape[1]:
                host[rows] = vals[:, :cols] if vals.shape[1] != cols else vals
            else:
                host[rows, col : col + cols] = vals[:, :cols]


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
        sizes = []
        for cols in self.cols:
            nf = sum(len(m[0]) * len(cols[k]) for k, m in moves.items())
            ne = sum(len(m[2]) * len(cols[k]) for k, m in moves.items())
            sizes.append(max(nf, ne))
        n = _bucket(max(sizes))
        fill_pos, fill_vals, evict_pos, parts = [], [], [], []
        for i, (buf, cols, a) in enumerate(zip(self.buffers, self.cols, arrays, strict=True)):
            size = a.shape[0]  # padding positions: out of range (dropped / read as zeros)
            fp = np.full(n, size, np.int32)
            ep = np.full(n, size, np.int32)
            fv = np.zeros((n, *a.shape[1:]), a.dtype)
            f_at = e_at = 0
            for key, (fs, fr, es, er) in moves.items():
                src = host[key][buf.field]
                for k, c in enumerate(cols[key]):
                    if len(fs):
                        fp[f_at : f_at + len(fs)] = c.positions(fs)
                        if a.ndim == 1:
                            np.take(src, fr, out=fv[f_at : f_at + len(fs)])
                        elif c.col == 0 and c.cols == src.shape[1] == a.shape[1]:
                            np.take(src, fr, axis=0, out=fv[f_at : f_at + len(fs)])
                        else:
                            fv[f_at : f_at + len(fs), : c.cols] = src[fr, c.col : c.col + c.cols]
                        f_at += len(fs)
                    if len(es) and (a.ndim == 2 or k == 0):  # a row-wise field: one copy
                        ep[e_at : e_at + len(es)] = c.positions(es)
                        parts.append((i, src, er, e_at, c.col, c.cols))
                        e_at += len(es)
            fill_pos.append(fp)
            fill_vals.append(fv)
            evict_pos.append(ep)
        if n not in self._programs:
            shardings = [a.sharding for a in arrays]
            self._programs[n] = jax.jit(_move, donate_argnums=0, out_shardings=(shardings, None))
        new, evicted = self._programs[n](list(arrays), evict_pos, fill_pos, fill_vals)
        return new, Pending(evicted, parts)


def _move(arrays, evict_pos, fill_pos, fill_vals):
    """Reads the evicted slots, then writes the filled ones (the same slot may be both)."""
    evicted = [
        a.at[e].get(mode="fill", fill_value=0) for a, e in zip(arrays, evict_pos, strict=True)
    ]
    new = [a.at[p].set(v, mode="drop") for a, p, v in zip(arrays, fill_pos, fill_vals, strict=True)]
    return new, evicted


@functools.cache
def _bucket(n: int) -> int:
    """Padded move sizes, powers of two from 256, so a run compiles a few programs."""
    return max(256, 1 << max(0, n - 1).bit_length())
