"""Row resets (managed-collision evictions) of a sharded collection.

The sharded form of :func:`jaxrec.embedding.reset.reset_table_rows`: a logical
row of a table lives in one width group (column blocks of one table share
it, see ``layout.py``), once per column block, so a reset writes the fresh
row's column slices at each of them (the values of the unsharded reset:
``init_rows`` with the same keys). The train step then resets the optimizer
state of those physical rows (:func:`reset_optimizer_rows`); row-wise state,
which column shards hold a copy of, is reset in every copy alike.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..embedding.optimizer import SubGroup, state_key
from ..embedding.reset import init_rows
from ..embedding.sparse_update import reset_state_rows
from ..embedding.tape import record_reset


def reset_rows(coll, table: str, rows: jax.Array, key: jax.Array) -> None:
    """Re-initialises logical ``rows`` ``[K]`` of ``table`` in the sharded ``coll``, in
    place (fill entries outside ``[0, num_embeddings)`` are ignored)."""
    names = [t.name for t in coll.table_configs]
    if table not in names:
        raise KeyError(f"reset_table_rows: no table {table!r}; tables are {names}")
    if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise TypeError(f"rows must be a [K] integer array, got {rows.shape=} {rows.dtype=}")
    config = coll.config(table)
    rows = rows.astype(jnp.int32)
    valid = (rows >= 0) & (rows < config.num_embeddings)
    tkey = jax.random.fold_in(key, names.index(table))
    fresh = init_rows(config, tkey, jnp.where(valid, rows, 0))
    name, total, pieces = _pieces(coll, table)
    phys, values = [], []
    for p in pieces:  # one [K] write per shard of the table
        mine = valid & (rows >= p.row0) & (rows < p.row0 + p.nrows)
        phys.append(jnp.where(mine, p.start + rows - p.row0, total))
        cols = fresh[:, p.col0 : p.col0 + p.ncols]
        values.append(jnp.pad(cols, ((0, 0), (0, p.buffer_ncols - p.ncols))))
    phys, values = jnp.concatenate(phys), jnp.concatenate(values)
    var = coll.weights[name]

    def write(buf):  # as reset_table_rows: read the old rows in the branch that writes
        old = buf.at[phys].get(mode="fill", fill_value=0)
        new = jnp.where((phys < total)[:, None], values.astype(buf.dtype), old)
        return buf.at[phys].set(new, mode="drop"), old

    def keep(buf):
        return buf, jnp.zeros((phys.shape[0], buf.shape[1]), buf.dtype)

    new, old = jax.lax.cond(jnp.any(valid), write, keep, var.get_value())
    var.set_value(new)
    record_reset(coll, name, phys, old)


class _Piece(NamedTuple):
    """One shard of a table in its buffer: logical rows ``[row0, row0 + nrows)``, columns
    ``[col0, col0 + ncols)`` at physical rows from ``start`` (``buffer_ncols`` wide)."""

    start: int
    row0: int
    nrows: int
    col0: int
    ncols: int
    buffer_ncols: int


def _pieces(coll, table: str) -> tuple[str, int, list[_Piece]]:
    """``(buffer name, buffer rows, the table's pieces in it)``."""
    layout = coll.layout
    for rg in coll.replicated_groups:
        if table in rg.tables:
            lo = rg.row_offsets[list(rg.tables).index(table)]
            cfg = coll.config(table)
            d = rg.embedding_dim
            return coll.dp_buffer(rg), rg.num_rows, [_Piece(lo, 0, cfg.num_embeddings, 0, d, d)]
    for g in layout.groups:
        pieces = [
            _Piece(
                rank * g.rows_per_rank + s.local_offset,
                s.row0,
                s.nrows,
                s.col0,
                g.width(s.table, s.row0, s.col0),
                g.ncols,
            )
            for rank, shards in enumerate(g.shards)
            for s in shards
            if s.table == table
        ]
        if pieces:
            return g.name, layout.world_size * g.rows_per_rank, pieces
    raise KeyError(f"table {table!r} is not in the layout")


def reset_optimizer_rows(coll, optimizer, path, group: str, sparse_state, rows) -> dict:
    """``sparse_state`` with the state rows of physical ``rows`` of buffer ``group`` at their
    initial values (``count`` is left alone, as the unsharded reset leaves it)."""
    groups = coll._groups_by_name()
    g = groups[group]
    if coll.buffers[group].replicated:
        num_rows, ncols = g.num_rows, g.embedding_dim
    else:
        num_rows, ncols = coll.layout.world_size * g.rows_per_rank, g.ncols
    opt = coll._group_optimizer(optimizer, set(g.tables))
    key = state_key(path, group, 0)
    sub = SubGroup(opt, (True,), (0,), num_rows)
    return {**sparse_state, key: reset_state_rows(sub, sparse_state[key], rows, ncols)}
