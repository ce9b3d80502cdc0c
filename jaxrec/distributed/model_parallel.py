"""DistributedModelParallel: shard a model's embedding collections, replicate the rest."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..embedding.collection import replace_collection
from ..embedding.optimizer import CombinedOptimizer
from ..modules.embedding_bag_collection import EmbeddingBagCollection
from ..modules.embedding_collection import EmbeddingCollection
from ..modules.feature_processor import FeatureProcessedEmbeddingBagCollection
from ..modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
from ..optim.base import SparseOptimizer
from ..sparse import KeyedJaggedTensor, pad_strides, to_id_words
from .abstract_build import build_abstract, draw_unsharded, is_abstract
from .capacity import CAPACITY_FACTOR
from .global_mc import GlobalBatchManagedCollision
from .planner import ParameterConstraints, plan_for_model
from .qcomms import QCommsConfig
from .sharded_base import ShardedCollection, ShardSource
from .sharded_ebc import ShardedEmbeddingBagCollection
from .sharded_ec import ShardedEmbeddingCollection
from .sharded_fp import ShardedFeatureProcessedEmbeddingBagCollection
from .sharded_zch import ShardedHashZchCollection, check_row_wise_plan, is_dynamic
from .types import EmbeddingComputeKernel, ShardingPlan

SHARDERS = {
    EmbeddingBagCollection: ShardedEmbeddingBagCollection,
    EmbeddingCollection: ShardedEmbeddingCollection,
}
# Modules around a collection, and the attribute holding it: when it is sharded
# the module is adapted to stacked batches too (see _adapt).
WRAPPED = {
    FeatureProcessedEmbeddingBagCollection: "_embedding_bag_collection",
    BaseManagedCollisionEmbeddingCollection: "_embedding_module",
}


def DistributedModelParallel(  # noqa: N802 (TorchRec's name)
    model: nnx.Module | Callable[[], nnx.Module],
    plan: ShardingPlan | None,
    mesh: jax.sharding.Mesh,
    *,
    capacity: int | Mapping[str, int] | None = None,
    overflow: str = "exact",
    optimizer: CombinedOptimizer | SparseOptimizer | str | None = None,
    pooling_factors: Mapping[str, float] | None = None,
    capacity_factor: float = CAPACITY_FACTOR,
    qcomms: QCommsConfig | None = None,
    exchange: str = "padded",
) -> nnx.Module:
    """Shards every embedding collection of ``model`` that ``plan`` names.

    ``model`` is a built module (its tables are copied shard by shard), or its
    constructor, a function of no arguments (TorchRec's ``meta`` device): the model
    is then built abstractly (``nnx.eval_shape``), planned, and each device draws
    only its own shards, with the values the eager build ``model()`` has; no device
    or host holds a whole table (dense layers are built replicated, as eagerly).

    ``EmbeddingBagCollection`` s become :class:`ShardedEmbeddingBagCollection`
    and ``EmbeddingCollection`` s :class:`ShardedEmbeddingCollection`, in place
    (plan keys are module paths joined with ``.``, e.g. ``"sparse_arch.ebc"``);
    every other variable is replicated over ``mesh``. The collection inside a
    ``FeatureProcessedEmbeddingBagCollection`` or a managed-collision collection
    is sharded under its own path (as the planner names it) or the wrapper's
    (as TorchRec's plans do); the feature-processed one becomes a
    :class:`ShardedFeatureProcessedEmbeddingBagCollection`, the managed-collision
    one remaps the global batch with its replicated modules
    (:class:`~jaxrec.distributed.global_mc.GlobalBatchManagedCollision`), or, when its
    modules are all ``HashZchManagedCollisionModule`` s (dynamic tables, which the plan
    must shard ``row_wise()``), shards their index by the id's hash
    (:class:`~jaxrec.distributed.ShardedHashZchCollection`). With ``plan=None`` the
    planner (:func:`jaxrec.distributed.planner.plan_for_model`) plans every
    ``EmbeddingBagCollection`` and ``EmbeddingCollection``, sizing optimizer
    state for ``optimizer`` (the sparse or combined optimizer you will train
    with; default row-wise Adagrad).
    Train with :func:`jaxrec.train.make_train_step` on batches from
    :func:`shard_batch`: dense gradients come out of XLA's SPMD partitioning
    already averaged over the global batch (the loss is a mean over it), fused
    updates run on the local shards. ``capacity``, ``overflow``,
    ``pooling_factors`` (``{feature: mean ids per bag}``, which size the id
    exchange), ``capacity_factor``, ``qcomms`` and ``exchange``: see
    :class:`ShardedEmbeddingBagCollection`; the same ``pooling_factors`` and
    ``capacity`` reach the planner when ``plan=None``.
    """
    init_keys: dict[str, jax.Array] = {}
    if not isinstance(model, nnx.Module):
        if not callable(model):
            raise TypeError(
                "model must be an nnx.Module or a function of no arguments that builds one, "
                f"got {type(model).__name__}"
            )
        _check_auto(mesh)
        model, init_keys = build_abstract(model, mesh)
    elif is_abstract(model):
        raise ValueError(
            "the model is abstract (nnx.eval_shape): its shapes carry no values to shard. "
            "Pass its constructor instead, DistributedModelParallel(lambda: Model(...), plan, "
            "mesh): each device then draws its own shards, with the eager build's values"
        )
    _check_auto(mesh)
    if plan is None:
        plan = plan_for_model(
            model,
            mesh,
            optimizer=optimizer,
            capacity_factor=capacity_factor,
            capacity=None if isinstance(capacity, Mapping) else capacity,  # groups unknown yet
            constraints=_pooling_constraints(model, pooling_factors),
        )
    options = dict(
        capacity=capacity,
        overflow=overflow,
        pooling_factors=pooling_factors,
        capacity_factor=capacity_factor,
        qcomms=qcomms,
        exchange=exchange,
    )
    cached = [
        f"{m}.{t}"
        for m, mp in plan.plan.items()
        for t, p in mp.items()
        if p.compute_kernel is EmbeddingComputeKernel.FUSED_UVM_CACHING
    ]
    if cached:
        raise ValueError(
            f"tables {cached} are planned as fused_uvm_caching (host memory + a device cache): "
            "build the model's collection from jaxrec.cache.device_plan(configs, module_plan) "
            "(its tables become cache slots), shard it with that plan, and keep the tables in "
            "a jaxrec.cache.RowCache; or forbid caching with ParameterConstraints(hbm_only=True)"
        )
    found = set()
    for path, module in list(nnx.iter_modules(model)):  # children before their parents
        name = ".".join(map(str, path))
        sharder = SHARDERS.get(type(module))
        if sharder is not None and name in plan.plan:
            mine = _own(module, options, init_keys.get(name))
            sharded = sharder(module, plan.plan[name], mesh, **mine)
            replace_collection(model, path, sharded)
            found.add(name)
        attr = next((a for t, a in WRAPPED.items() if isinstance(module, t)), None)
        if attr is not None:
            _adapt(model, path, module, attr, plan, mesh, options, found, init_keys)
    features = {
        f
        for _, m in nnx.iter_modules(model)
        if isinstance(m, ShardedCollection)
        for t in m.table_configs
        for f in t.feature_names
    }
    stray = sorted(set(pooling_factors or {}) - features)
    if stray:
        raise ValueError(
            f"pooling_factors name unknown features {stray}; the sharded collections read "
            f"{sorted(features)}"
        )
    unknown = sorted(set(plan.plan) - found)
    if unknown:
        raise ValueError(
            f"the plan names modules {unknown} that are not embedding collections of the model"
        )
    if init_keys:
        draw_unsharded(model, init_keys, mesh)
    replicated = NamedSharding(mesh, P())
    placed = {  # a dynamic table's index, sharded over its slots already
        id(v)
        for _, m in nnx.iter_modules(model)
        if isinstance(m, ShardedHashZchCollection)
        for _, v in nnx.to_flat_state(nnx.state(m))
    }
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Not(_is_sharded_table))):
        if id(var) not in placed:
            var.set_value(jax.device_put(var.get_value(), replicated))
    return model


def _check_auto(mesh: jax.sharding.Mesh) -> None:
    explicit = [
        n
        for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == jax.sharding.AxisType.Explicit
    ]
    if explicit:
        raise ValueError(
            f"DistributedModelParallel needs a mesh with Auto axes; axes {explicit} are "
            "Explicit (jax.make_mesh's default): build it with "
            "axis_types=(jax.sharding.AxisType.Auto,) * ndim"
        )


def _adapt(model, path, module, attr, plan, mesh, options, found, init_keys) -> None:
    """Shards ``module``'s collection if the plan names ``module`` (TorchRec's key), then
    adapts ``module`` to the stacked batches its sharded collection takes."""
    name = ".".join(map(str, path))
    inner = getattr(module, attr)
    if name in plan.plan:
        if isinstance(inner, ShardedCollection):
            raise ValueError(f"the plan names both {name!r} and {name}.{attr}: name one of them")
        sharder = SHARDERS[type(inner)]
        key = init_keys.get(f"{name}.{attr}")
        setattr(module, attr, sharder(inner, plan.plan[name], mesh, **_own(inner, options, key)))
        found.add(name)
    if not isinstance(getattr(module, attr), ShardedCollection):
        return
    if isinstance(module, FeatureProcessedEmbeddingBagCollection):
        replace_collection(model, path, ShardedFeatureProcessedEmbeddingBagCollection(module))
    else:
        mcc = module._managed_collision_collection
        if is_dynamic(mcc):  # dynamic tables: the index sharded by the id's hash
            module_plan = plan.plan.get(name) or plan.plan[f"{name}.{attr}"]
            for c in mcc.embedding_configs():
                check_row_wise_plan(c.name, c.num_embeddings, module_plan[c.name], mesh.size)
            module._managed_collision_collection = ShardedHashZchCollection(mcc, mesh)
        else:
            module._managed_collision_collection = GlobalBatchManagedCollision(mcc)


def _own(module, options: dict, init_key=None) -> dict:
    """``options`` with the pooling factors of ``module``'s features only, and its init
    key when it is built from a constructor."""
    pf = options["pooling_factors"]
    if pf:
        feats = {f for t in module.table_configs for f in t.feature_names}
        options = {**options, "pooling_factors": {k: v for k, v in pf.items() if k in feats}}
    if init_key is not None:
        options = {**options, "init_key": init_key}
    return options


def _pooling_constraints(model, pooling_factors) -> dict | None:
    """Planner constraints carrying ``pooling_factors`` (per table, in feature order)."""
    if not pooling_factors:
        return None
    out = {}
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, tuple(SHARDERS)):  # what the planner plans
            continue
        prefix = ".".join(map(str, path))
        for t in cast(ShardSource, module).table_configs:  # a SHARDERS key: a collection
            if any(f in pooling_factors for f in t.feature_names):
                pf = [float(pooling_factors.get(f, 1.0)) for f in t.feature_names]
                out[f"{prefix}.{t.name}" if prefix else t.name] = ParameterConstraints(
                    pooling_factors=pf
                )
    return out


def _is_sharded_table(path, var) -> bool:
    return any(str(p) == "weights" for p in path) or "overflow_count" in map(str, path)


def shard_batch(local_batches: Sequence[Any], mesh: jax.sharding.Mesh) -> Any:
    """Stacks one local batch per device into global arrays sharded over the batch.

    ``local_batches[d]`` is device ``d``'s batch (rank order = the mesh's flat
    device order): a pytree of KeyedJaggedTensors (same keys, capacities and
    stride on every device) and arrays ``[B, ...]``. KJT leaves become
    ``[world, ...]`` (one local KJT per device); arrays become ``[world * B, ...]``.
    Variable-batch (VBE) KJTs may hold different numbers of bags per key on each
    device (TorchRec's ``stride_per_key_per_rank``): each key is padded to the
    most any device holds (empty bags no sample reads), so they stack.
    Multi-process: pass either every device's batch, or only this process's
    devices' batches (in mesh order); each process then supplies its own.
    """
    devices = list(mesh.devices.flat)
    mine = [d for d in devices if d.process_index == jax.process_index()]
    if len(local_batches) not in (len(devices), len(mine)):
        raise ValueError(
            f"need one local batch per device: got {len(local_batches)} for {len(devices)} "
            f"devices ({len(mine)} in this process)"
        )
    spec = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    if len(local_batches) == len(devices) and len(mine) < len(devices):
        local_batches = [b for b, d in zip(local_batches, devices, strict=True) if d in mine]
    is_kjt = lambda x: isinstance(x, KeyedJaggedTensor)
    put = jax.device_put if len(mine) == len(devices) else jax.make_array_from_process_local_data

    def stack(*xs):
        if is_kjt(xs[0]):
            if any(x.variable_stride_per_key() for x in xs):
                xs = _common_strides(xs)
            metas = {
                (tuple(x.keys()), x.capacity_per_key(), x.stride(), tuple(x.stride_per_key()))
                for x in xs
            }
            if len(metas) != 1:
                raise ValueError(
                    "every device's KeyedJaggedTensor needs the same keys, capacities and stride; "
                    f"got {sorted(metas)}"
                )
            xs = _one_id_representation(xs)
            return jax.tree.map(
                lambda *ls: _put(put, np.stack([np.asarray(v) for v in ls]), spec), *xs
            )
        return _put(put, np.concatenate([np.asarray(x) for x in xs]), spec)

    return jax.tree.map(stack, local_batches[0], *local_batches[1:], is_leaf=is_kjt)


def _common_strides(kjts: Sequence[KeyedJaggedTensor]) -> list[KeyedJaggedTensor]:
    """The devices' VBE KJTs padded to each key's largest number of bags (one shape)."""
    if len({len(k.keys()) for k in kjts}) != 1:
        return list(kjts)  # the keys differ: the caller's check names them
    top = np.max([k.stride_per_key() for k in kjts], axis=0).tolist()
    return [pad_strides(k, top) for k in kjts]


def _one_id_representation(kjts: Sequence[KeyedJaggedTensor]) -> Sequence[KeyedJaggedTensor]:
    """The devices' KJTs with id words for all when any holds them (64-bit ids need
    more than int32 in one device's batch only): the stacked values need one shape."""
    if not any(k.is_wide() for k in kjts) or all(k.is_wide() for k in kjts):
        return kjts
    out = []
    for k in kjts:
        if not k.is_wide():
            children, aux = k.tree_flatten()
            ids = np.asarray(children[0])
            words = to_id_words(ids) if ids.dtype.kind in "iu" else ids
            k = KeyedJaggedTensor.tree_unflatten(aux, (words, *children[1:]))
        out.append(k)
    return out


def _put(put, x: np.ndarray, spec: NamedSharding) -> jax.Array:
    return put(x, spec) if put is jax.device_put else put(spec, x)
