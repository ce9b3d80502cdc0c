"""The plan-independent ("logical") view of a train state, and placing it under any plan.

A :class:`LogicalState` holds what a checkpoint holds: the dense parameters,
the other model variables and the dense optax state (their trees are the same
under every sharding plan), and every embedding table with its sparse
optimizer state in natural row order, unpadded. :func:`place_state` converts
it into the layout and shardings of any target state (another plan, another
device count, unsharded), which is how a checkpoint reshards on restore.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from ..embedding.collection import embedding_collections
from ..embedding.optimizer import CombinedOptimizer
from ..train.step import TrainState, merge_model
from .layout import replace_tables, table_buffers
from .paths import PLAN_LOCAL, components, dense_leaves, is_key, is_variable, nest, table_key
from .spec import check_compatible, logical_spec, state_spec


class LogicalState(NamedTuple):
    """A :class:`~jaxrec.train.TrainState` in the layout every plan shares.

    Attributes:
        params: the ``nnx.Param`` values as nested string-keyed dicts (the
            state's tree paths, e.g. ``params["head"]["kernel"]["value"]``).
        rest: the other model variables, likewise (mesh-shaped diagnostics such
            as ``overflow_count`` are left out).
        dense_opt: the dense optax state, likewise.
        tables: ``{"<module path>.<prefix>.<table>": {"weight": [num_embeddings,
            dim], <state field>: [num_embeddings, dim] | [num_embeddings],
            "count": []}}`` as host (numpy) arrays; the key is TorchRec's
            ``state_dict`` key without ``.weight`` (``"ebc.embedding_bags.t1"``).
    """

    params: dict
    rest: dict
    dense_opt: dict
    tables: dict


def logical_state(
    graphdef: nnx.GraphDef, optimizer: CombinedOptimizer, state: TrainState
) -> LogicalState:
    """The plan-independent view of ``state`` (TorchRec: ``state_dict()`` of the
    model plus its fused optimizer), whole in host memory.

    Tables and their optimizer state are gathered into host memory (on every
    process): the host needs room for all of them (``CheckpointManager`` never
    does this; it streams bounded slices). Dense leaves stay device arrays (typed
    PRNG keys become their ``key_data``).

    Args:
        graphdef, state: from :func:`jaxrec.train.init_train_state` (any plan).
        optimizer: the ``CombinedOptimizer`` the state was built with.
    """
    layout = table_buffers(graphdef, optimizer, state)
    shapes = _shapes(graphdef, state)
    tables: dict[str, dict] = {}
    for buf in layout.buffers:
        host = gathered(buf.device_array)
        for b in buf.blocks:
            entry = tables.setdefault(b.table, {})
            if buf.field not in entry:
                rows, dim = shapes[b.table]
                entry[buf.field] = np.zeros((rows, dim) if host.ndim == 2 else (rows,), host.dtype)
            if host.ndim == 2:
                entry[buf.field][b.row : b.row + b.rows, b.col : b.col + b.cols] = host[
                    b.start : b.start + b.rows, : b.cols
                ]
            else:
                entry[buf.field][b.row : b.row + b.rows] = host[b.start : b.start + b.rows]
    for key, keys in layout.shared_counts.items():
        count = np.array(jax.device_get(_first_shard(state.opt_state.sparse[key].count)))
        for k in keys:
            if "count" in tables[k] and int(tables[k]["count"]) != int(count):
                raise ValueError(
                    f"table {k!r} has different optimizer step counts in its shard buffers "
                    f"({int(tables[k]['count'])} and {int(count)})"
                )
            tables[k]["count"] = count
    return LogicalState(
        params=nest(dense_leaves(state.params)),
        rest=nest(dense_leaves(state.rest)),
        dense_opt=nest(dense_leaves(state.opt_state.dense)),
        tables=tables,
    )


def place_state(
    graphdef: nnx.GraphDef,
    optimizer: CombinedOptimizer,
    target: TrainState,
    logical: LogicalState,
) -> TrainState:
    """``logical`` in the layout and shardings of ``target`` (any plan, mesh or device count).

    ``target``'s values are not used, only its structure and shardings (build it
    with :func:`jaxrec.train.init_train_state` on the model sharded as wanted).
    Tables go through host memory: each process builds the whole physical
    buffers and places only its own devices' slices.

    Raises:
        ValueError: the logical state does not fit the target (missing or extra
            tables, shapes, optimizer state fields, dense leaves), or tables that
            share one optimizer state in the target have different step counts.
    """
    check_compatible(
        logical_spec(logical), state_spec(graphdef, optimizer, target), "the logical state"
    )
    layout = table_buffers(graphdef, optimizer, target)
    arrays = {}
    for buf in layout.buffers:
        host = np.zeros(buf.array.shape, buf.array.dtype)
        for b in buf.blocks:
            src = np.asarray(logical.tables[b.table][buf.field])
            if host.ndim == 2:
                host[b.start : b.start + b.rows, : b.cols] = src[
                    b.row : b.row + b.rows, b.col : b.col + b.cols
                ]
            else:
                host[b.start : b.start + b.rows] = src[b.row : b.row + b.rows]
        arrays[buf.where] = _put(host, buf.array)
    counts = {}
    for key, keys in layout.shared_counts.items():
        like = target.opt_state.sparse[key].count
        counts[key] = _put(common_count(keys, logical.tables, like.dtype), like)
    placed = replace_tables(target, arrays, counts)
    return placed._replace(
        params=place_dense(logical.params, target.params),
        rest=place_dense(logical.rest, target.rest),
        opt_state=placed.opt_state._replace(
            dense=place_dense(logical.dense_opt, target.opt_state.dense)
        ),
    )


def common_count(tables: Sequence[str], logical: Mapping[str, Mapping], dtype) -> np.ndarray:
    """The one step count of tables stored together; a clear error when they differ."""
    counts = {t: int(np.asarray(logical[t]["count"])) for t in tables}
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"tables {sorted(counts)} share one optimizer state here but have different "
            f"optimizer step counts {counts}; restore them under a plan/grouping that keeps "
            "them apart, or set their counts equal"
        )
    return np.asarray(next(iter(counts.values())), dtype)


def _shapes(graphdef, state) -> dict:
    model = merge_model(graphdef, state)
    out = {}
    for path, module in embedding_collections(model):
        for t in module.table_configs:
            out[table_key(path, module, t.name)] = (t.num_embeddings, t.embedding_dim)
    return out


def _first_shard(x: jax.Array):
    return x.addressable_data(0) if isinstance(x, jax.Array) else x


def place_dense(nested: Mapping, target: Any) -> Any:
    """``target``'s tree with values from ``nested`` on ``target``'s shardings."""

    def node(path, x):
        if isinstance(x, PLAN_LOCAL):
            return x
        return jax.tree_util.tree_map_with_path(lambda sub, leaf: leaf_at((*path, *sub), leaf), x)

    def leaf_at(path, leaf):
        value = nested
        for c in components(path):
            value = value[c]
        if is_key(leaf):
            data = _put(value, jax.random.key_data(leaf))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
        return _put(value, leaf)

    return jax.tree_util.tree_map_with_path(node, target, is_leaf=is_variable)


def _put(value: Any, like: Any) -> jax.Array:
    """``value`` as an array shaped and sharded like ``like``.

    Host values: each process places only its own devices' slices. Device
    values are ``device_put`` (in multi-process runs they must already be
    laid out over the target's devices, as orbax restores them).
    """
    sharding = like.sharding
    if isinstance(value, jax.Array):
        return jax.device_put(value.astype(like.dtype), sharding)
    value = np.asarray(value).astype(like.dtype, copy=False)
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def gathered(x: jax.Array) -> np.ndarray:
    """A host copy in ``x``'s dtype, gathered from every process when not fully addressable."""
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.array(x)
