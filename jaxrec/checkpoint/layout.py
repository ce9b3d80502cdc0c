"""A train state's table buffers as arrays with their blocks (what checkpoints move).

Every collection says where its tables sit (``table_blocks``, see
``jaxrec.embedding.blocks``); this module pairs those blocks with the state's
arrays: the weight buffers in ``state.tables`` and the optimizer state fields in
``state.opt_state.sparse``, and puts new arrays back in their place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from ..embedding.blocks import Block
from ..embedding.collection import embedding_collections
from ..embedding.optimizer import CombinedOptimizer, CombinedOptState
from ..optim.base import row_fields
from ..train.step import TrainState, merge_model
from .paths import components, table_key


class Buffer(NamedTuple):
    """One physical array of table rows and where it lives in the state.

    ``where`` is ``("tables", path components)`` for a weight buffer,
    ``("sparse", state key, field)`` for an optimizer state field, or ``("host", table
    key, field, whether this process writes it)`` for a host table's field
    (``jaxrec.cache``), whose ``array`` is the host numpy table itself.
    """

    field: str  # "weight" or the optimizer state field
    array: jax.Array | np.ndarray  # numpy: a host table's field (where[0] == "host")
    blocks: tuple[Block, ...]  # with table names made checkpoint keys
    where: tuple

    @property
    def device_array(self) -> jax.Array:
        """``array`` of a train state's buffer (a device array); a host table's raises."""
        if not isinstance(self.array, jax.Array):
            raise TypeError(
                f"buffer {'/'.join(map(str, self.where))} is a host table, not a device array"
            )
        return self.array


class Tables(NamedTuple):
    buffers: list[Buffer]
    shared_counts: dict[str, list[str]]  # state key -> the table keys sharing its count


class HostRows(Mapping):
    """A host table's fields (``jaxrec.cache``) holding its logical rows ``[lo, lo + n)``
    of ``total``: with several processes each holds its own devices' rows and writes
    them to a checkpoint. ``whole``: every process holds the whole table (a plain
    mapping of fields), and process 0 writes it."""

    def __init__(self, fields: Mapping[str, np.ndarray], lo: int, total: int, whole: bool = False):
        self.fields, self.lo, self.total, self.whole = dict(fields), int(lo), int(total), whole

    def __getitem__(self, field: str) -> np.ndarray:
        return self.fields[field]

    def __iter__(self):
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    @property
    def writes(self) -> bool:
        """Whether this process writes these rows to a checkpoint."""
        if self.whole:
            return jax.process_index() == 0
        return self.fields["weight"].shape[0] > 0


def host_rows(fields: Mapping[str, np.ndarray]) -> HostRows:
    """``fields`` as :class:`HostRows` (a plain mapping: the whole table)."""
    if isinstance(fields, HostRows):
        return fields
    rows = fields["weight"].shape[0]
    return HostRows(fields, 0, rows, whole=True)


HostTables = Mapping[str, Mapping[str, np.ndarray]]  # table key -> field -> host rows


def table_buffers(
    graphdef: nnx.GraphDef,
    optimizer: CombinedOptimizer,
    state: TrainState,
    host: HostTables | None = None,
) -> Tables:
    """Every table buffer of ``state`` (any plan) with its blocks.

    ``host``: tables kept in host memory (``jaxrec.cache``), by checkpoint key: their
    fields are buffers of their own (``where = ("host", key, field, whether this
    process writes them)``; :class:`HostRows` for a part of the table), and the
    state's buffers of those tables (device caches) are left out.
    """
    tables = _device_buffers(graphdef, optimizer, state)
    if not host:
        return tables
    buffers = []
    for buf in tables.buffers:
        blocks = tuple(b for b in buf.blocks if b.table not in host)
        if blocks:
            buffers.append(buf._replace(blocks=blocks))
    for key, fields in host.items():
        part = host_rows(fields)
        writes = part.writes
        for f, a in part.items():
            block = Block(key, part.lo, a.shape[0], 0, a.shape[1] if a.ndim == 2 else 0, 0)
            buffers.append(Buffer(f, a, (block,), ("host", key, f, writes)))
    return Tables(buffers, tables.shared_counts)


def _device_buffers(graphdef, optimizer, state) -> Tables:
    model = merge_model(graphdef, state)
    weights = {components(p)[:-1]: x for p, x in jax.tree_util.tree_leaves_with_path(state.tables)}
    buffers, shared = [], {}
    for path, module in embedding_collections(model):
        layout = module.table_blocks(optimizer, path)
        names = {t.name: table_key(path, module, t.name) for t in module.table_configs}
        for name, blocks in layout.weights.items():
            where = (*map(str, path), "weights", name)
            if where not in weights:
                raise ValueError(f"the state has no table buffer {'/'.join(where)}")
            buffers.append(
                Buffer("weight", weights[where], _keyed(blocks, names), ("tables", where))
            )
        for key, blocks in layout.states.items():
            try:
                st = state.opt_state.sparse[key]
            except KeyError:
                raise ValueError(
                    f"the state has no sparse optimizer state {key!r} for the collection at "
                    f"{'.'.join(map(str, path)) or '(root)'}: pass the optimizer the state was "
                    "built with"
                ) from None
            for f in row_fields(st):
                buffers.append(Buffer(f, getattr(st, f), _keyed(blocks, names), ("sparse", key, f)))
            shared[key] = sorted({b.table for b in _keyed(blocks, names)})
    return Tables(buffers, shared)


def replace_tables(
    state: TrainState, arrays: Mapping[tuple, Any], counts: Mapping[str, Any]
) -> TrainState:
    """``state`` with the buffers at ``arrays``' places (``Buffer.where``) and the sparse
    states' ``count`` s from ``counts`` (state key -> scalar array)."""
    tables = jax.tree_util.tree_map_with_path(
        lambda p, x: arrays.get(("tables", components(p)[:-1]), x), state.tables
    )
    sparse = {}
    for key, st in state.opt_state.sparse.items():
        fields = {f: arrays.get(("sparse", key, f), getattr(st, f)) for f in row_fields(st)}
        sparse[key] = st._replace(count=counts.get(key, st.count), **fields)
    opt = CombinedOptState(state.opt_state.dense, sparse)
    return state._replace(tables=tables, opt_state=opt)


def _keyed(blocks: tuple[Block, ...], names: Mapping[str, str]) -> tuple[Block, ...]:
    return tuple(b._replace(table=names[b.table]) for b in blocks)
