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
    for base, r0, nr, c0, w, ncols in pieces:  # one [K] write per shard of the table
        mine = valid & (rows >= r0) & (rows < r0 + nr)
        phys.append(jnp.where(mine, base + rows - r0, total))
        values.append(jnp.pad(fresh[:, c0 : c0 + w], ((0, 0), (0, ncols - w))))
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


def _pieces(coll, table: str):
    """``(buffer, rows, [(first physical row, row0, nrows, col0, ncols, buffer ncols)])``."""
    layout = coll.layout
    for rg in coll.replicated_groups:
        if table in rg.tables:
            lo = rg.row_offsets[list(rg.tables).index(table)]
            cfg = coll.config(table)
            d = rg.embedding_dim
            return "dp_" + rg.name, rg.num_rows, [(lo, 0, cfg.num_embeddings, 0, d, d)]
    for g in layout.groups:
        pieces = [
            (rank * g.rows_per_rank + off, r0, nr, c0, g.width(t, r0, c0), g.ncols)
            for rank, shards in enumerate(g.shards)
            for t, r0, nr, c0, off in shards
            if t == table
        ]
        if pieces:
            return g.name, layout.world_size * g.rows_per_rank, pieces
    raise KeyError(f"table {table!r} is not in the layout")


def reset_optimizer_rows(coll, optimizer, path, group: str, sparse_state, rows) -> dict:
    """``sparse_state`` with the state rows of physical ``rows`` of buffer ``group`` at their
    initial values (``count`` is left alone, as the unsharded reset leaves it)."""
    groups = coll._groups_by_name()
    g = groups[group]
    if group.startswith("dp_"):
        tables, num_rows, ncols = set(g.tables), g.num_rows, g.embedding_dim
    else:
        tables = {s[0] for r in g.shards for s in r}
        num_rows, ncols = coll.layout.world_size * g.rows_per_rank, g.ncols
    opt = coll._group_optimizer(optimizer, tables)
    key = state_key(path, group, 0)
    sub = SubGroup(opt, (True,), (0,), num_rows)
    return {**sparse_state, key: reset_state_rows(sub, sparse_state[key], rows, ncols)}
