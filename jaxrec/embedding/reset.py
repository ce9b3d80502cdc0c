"""Re-initialising table rows inside a forward pass (managed-collision evictions).

When a managed-collision module evicts ids, the table slots they held are
given to new ids. TorchRec then resets those rows to the table's initialiser
and their optimizer state (momentum, accumulators) to its initial value
before the new ids look them up: evict, reset, lookup. jaxrec does the same
in one jitted step:

1. the module calls :func:`reset_table_rows` during its forward, *before* its
   lookup: the rows' weights are re-drawn and written into the collection's
   table variable (a ``mode="drop"`` scatter of a static number of rows), so
   the lookup that follows reads the fresh rows;
2. inside a train step the call is also recorded on the tape; the step takes
   the reset tables from the forward and, before its sparse update, writes
   the optimizer's initial values into the state rows of the reset rows
   (``TableStorage.reset_optimizer_rows``). A row that is both reset and looked up in
   the step is therefore updated from its fresh weights and fresh state.

Static shapes: ``rows`` is a fixed-size ``[K]`` list in which entries past
the real evictions hold an out-of-range fill (``>= num_embeddings``). Both
writes sit under a ``lax.cond`` on "any real row", so a step that evicts
nothing draws no random numbers and scatters nothing; the scatters run in
place on the step's donated buffers (no table-sized temporary).

Re-initialised values: row ``r`` of table ``t`` drawn at reset call ``c``
(a counter kept by the calling module) gets
``init(fold_in(fold_in(fold_in(key, c), t), r))``: uniform in the table's
``[weight_init_min, weight_init_max]`` (the default, TorchRec's), or
``init_fn(row_key, (1, D), dtype)[0]`` for a table with an ``init_fn`` (an
initialiser whose scale depends on the number of rows sees 1; TorchRec
likewise calls ``init_fn`` on the evicted rows only). A value depends on the
key, the call and the row only: not on ``K`` or the row's position in the
list, so it can be reproduced row by row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..configs import BaseEmbeddingConfig
from .tables import TableStorage
from .tape import record_reset


def init_rows(config: BaseEmbeddingConfig, key: jax.Array, rows: jax.Array) -> jax.Array:
    """Fresh initial values ``[K, D]`` (the table's dtype) for ``rows`` ``[K]`` of a table.

    Row ``r`` draws from ``fold_in(key, r)`` (see the module docstring), so
    the values do not depend on which other rows are drawn with it.
    """
    dim, dtype = config.embedding_dim, config.dtype
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, rows.astype(jnp.uint32))
    if config.init_fn is not None:
        fn = config.init_fn

        def one(k):
            return jnp.asarray(fn(k, (1, dim), dtype)).reshape(dim)

        return jax.vmap(one)(keys).astype(dtype)
    lo, hi = config.get_weight_init_min(), config.get_weight_init_max()
    draw = jax.vmap(lambda k: jax.random.uniform(k, (dim,), jnp.float32, lo, hi))
    return draw(keys).astype(dtype)


def reset_table_rows(storage: TableStorage, table: str, rows: jax.Array, key: jax.Array) -> None:
    """Re-initialises ``rows`` of ``table`` in ``storage`` (an EBC or EC), in place.

    Writes fresh weights into the collection's table variable now (so a
    lookup that follows reads them) and, inside a train step, records the rows
    so that the step resets their optimizer state before its sparse update.

    Args:
        storage: the ``EmbeddingBagCollection`` / ``EmbeddingCollection``
            holding the table (part of the model being trained).
        table: the table's name.
        rows: ``[K]`` int row ids of the table; entries outside
            ``[0, num_embeddings)`` are fill and ignored.
        key: a PRNG key for this call (fold in a per-call counter: the same
            key and row give the same values).
    """
    if not isinstance(storage, TableStorage):
        own = getattr(storage, "reset_table_rows", None)  # a sharded collection's own
        if own is None:
            raise NotImplementedError(
                f"reset_table_rows needs an EmbeddingBagCollection / EmbeddingCollection "
                f"(unsharded or sharded), got {type(storage).__name__}"
            )
        return own(table, rows, key)
    names = [t.name for t in storage.table_configs]
    if table not in names:
        raise KeyError(f"reset_table_rows: no table {table!r}; tables are {names}")
    if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise TypeError(f"rows must be a [K] integer array, got {rows.shape=} {rows.dtype=}")
    group, lo, n = storage.locate(table)
    config = storage.config(table)
    total = group.num_rows
    rows = rows.astype(jnp.int32)
    valid = (rows >= 0) & (rows < n)
    group_rows = jnp.where(valid, rows + lo, total)  # fill stays out of range, never negative
    var = storage.weights[group.name]
    tkey = jax.random.fold_in(key, names.index(table))

    def write(w):
        # The rows' previous values, read before the write in the same branch (so the
        # write stays in place): a step that skips its update puts them back.
        old = w.at[group_rows].get(mode="fill", fill_value=0)
        values = init_rows(config, tkey, jnp.where(valid, rows, 0))
        # Fill entries are dropped by the write anyway; taking them from ``old`` makes the
        # write wait for that read (else XLA copies the table to keep both alive).
        values = jnp.where(valid[:, None], values, old)
        return w.at[group_rows].set(values, mode="drop"), old

    def keep(w):
        return w, jnp.zeros((rows.shape[0], w.shape[1]), w.dtype)

    new, old = jax.lax.cond(jnp.any(valid), write, keep, var.get_value())
    var.set_value(new)
    record_reset(storage, group.name, group_rows, old)
