"""The plan-independent ("logical") view of a train state, and placing it under any plan.

A :class:`LogicalState` holds what a checkpoint holds: the dense parameters,
the other model variables and the dense optax state (their trees are the same
under every sharding plan), and every embedding table with its sparse
optimizer state in natural row order, unpadded. :func:`place_state` converts
it into the layout and shardings of any target state (another plan, another
device count, unsharded), which is how a checkpoint reshards on restore.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from ..embedding.collection import embedding_collections
from ..embedding.optimizer import CombinedOptimizer, CombinedOptState
from ..train.step import TrainState, merge_model
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
    model plus its fused optimizer).

    Tables and their optimizer state are gathered into host memory (on every
    process): the host needs room for all of them. Dense leaves stay device
    arrays (typed PRNG keys become their ``key_data``).

    Args:
        graphdef, state: from :func:`jaxrec.train.init_train_state` (any plan).
        optimizer: the ``CombinedOptimizer`` the state was built with.
    """
    model = merge_model(graphdef, state)
    tables = {}
    for path, module in embedding_collections(model):
        try:
            entries = module.logical_tables(optimizer, path, state.opt_state.sparse)
        except KeyError as e:
            raise ValueError(
                f"the state has no sparse optimizer state {e} for the collection at "
                f"{path}: pass the optimizer the state was built with"
            ) from None
        for name, entry in entries.items():
            tables[table_key(path, module, name)] = entry
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
    buffers of every collection and places only its own devices' slices.

    Raises:
        ValueError: the logical state does not fit the target (missing or extra
            tables, shapes, optimizer state fields, dense leaves), or tables that
            share one optimizer state in the target have different step counts.
    """
    check_compatible(
        logical_spec(logical), state_spec(graphdef, optimizer, target), "the logical state"
    )
    model = merge_model(graphdef, target)
    weights, sparse = {}, {}
    for path, module in embedding_collections(model):
        mine = {
            t.name: logical.tables[table_key(path, module, t.name)] for t in module.table_configs
        }
        w, s = module.physical_tables(optimizer, path, mine)
        weights.update({(*map(str, path), "weights", n): x for n, x in w.items()})
        sparse.update(s)
    tables = jax.tree_util.tree_map_with_path(
        lambda p, x: _put(weights[components(p)[:-1]], x), target.tables
    )
    if set(sparse) != set(target.opt_state.sparse):
        raise ValueError(
            f"the target's sparse optimizer states {sorted(target.opt_state.sparse)} do not "
            f"match {sorted(sparse)} from the optimizer given: build the target with it"
        )
    sparse = {
        k: jax.tree.map(_put, sparse[k], target.opt_state.sparse[k])
        for k in target.opt_state.sparse
    }
    return TrainState(
        params=_place_dense(logical.params, target.params),
        tables=tables,
        rest=_place_dense(logical.rest, target.rest),
        opt_state=CombinedOptState(_place_dense(logical.dense_opt, target.opt_state.dense), sparse),
    )


def _place_dense(nested: Mapping, target: Any) -> Any:
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
