"""DistributedModelParallel: shard a model's embedding collections, replicate the rest."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..modules.embedding_bag_collection import EmbeddingBagCollection
from ..sparse import KeyedJaggedTensor
from .sharded_ebc import ShardedEmbeddingBagCollection
from .types import ShardingPlan


def DistributedModelParallel(  # noqa: N802 (TorchRec's name)
    model: nnx.Module,
    plan: ShardingPlan,
    mesh: jax.sharding.Mesh,
    *,
    capacity: int | None = None,
    overflow: str = "warn",
) -> nnx.Module:
    """Shards every ``EmbeddingBagCollection`` of ``model`` that ``plan`` names.

    The collections are replaced in place by :class:`ShardedEmbeddingBagCollection`
    (plan keys are module paths joined with ``.``, e.g. ``"sparse_arch.ebc"``);
    every other variable is replicated over ``mesh``. Train with
    :func:`jaxrec.train.make_train_step` on batches from :func:`shard_batch`:
    dense gradients come out of XLA's SPMD partitioning already averaged over
    the global batch (the loss is a mean over it), fused updates run on the
    local shards.
    """
    found = set()
    for path, module in list(nnx.iter_modules(model)):
        name = ".".join(map(str, path))
        if isinstance(module, EmbeddingBagCollection) and name in plan.plan:
            sharded = ShardedEmbeddingBagCollection(
                module, plan.plan[name], mesh, capacity=capacity, overflow=overflow
            )
            parent = model
            for key in path[:-1]:
                parent = (
                    parent[key]
                    if isinstance(key, int) or not hasattr(parent, key)
                    else getattr(parent, key)
                )
            if isinstance(parent, nnx.Dict | nnx.List) or isinstance(path[-1], int):
                parent[path[-1]] = sharded
            else:
                setattr(parent, path[-1], sharded)
            found.add(name)
    unknown = sorted(set(plan.plan) - found)
    if unknown:
        raise ValueError(
            f"the plan names modules {unknown} that are not EmbeddingBagCollections of the model"
        )
    replicated = NamedSharding(mesh, P())
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Not(_is_sharded_table))):
        var.set_value(jax.device_put(var.get_value(), replicated))
    return model


def _is_sharded_table(path, var) -> bool:
    return any(str(p) == "weights" for p in path) or "overflow_count" in map(str, path)


def shard_batch(local_batches: Sequence[Any], mesh: jax.sharding.Mesh) -> Any:
    """Stacks one local batch per device into global arrays sharded over the batch.

    ``local_batches[d]`` is device ``d``'s batch (rank order = the mesh's flat
    device order): a pytree of KeyedJaggedTensors (same keys, capacities and
    stride on every device) and arrays ``[B, ...]``. KJT leaves become
    ``[world, ...]`` (one local KJT per device); arrays become ``[world * B, ...]``.
    """
    if len(local_batches) != mesh.size:
        raise ValueError(
            f"need one local batch per device: got {len(local_batches)} for {mesh.size}"
        )
    spec = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    is_kjt = lambda x: isinstance(x, KeyedJaggedTensor)
    first = local_batches[0]

    def stack(*xs):
        if is_kjt(xs[0]):
            metas = {(tuple(x.keys()), x.capacity_per_key(), x.stride()) for x in xs}
            if len(metas) != 1:
                raise ValueError(
                    "every device's KeyedJaggedTensor needs the same keys, capacities and stride; "
                    f"got {sorted(metas)}"
                )
            return jax.tree.map(
                lambda *ls: jax.device_put(np.stack([np.asarray(v) for v in ls]), spec), *xs
            )
        return jax.device_put(jnp.concatenate([jnp.asarray(x) for x in xs]), spec)

    return jax.tree.map(stack, first, *local_batches[1:], is_leaf=is_kjt)
