"""Managed collision in front of a sharded collection: one remap of the global batch.

When ``DistributedModelParallel`` shards the collection of a
``ManagedCollisionEmbeddingBagCollection`` (or ``...EmbeddingCollection``), its
``ManagedCollisionCollection`` stays replicated and is wrapped in
:class:`GlobalBatchManagedCollision`: the stacked batch (one local batch per
device) is laid out as the concatenated global batch (per key, every
device's ids in device order, the layout of ``shard_batch``'s inputs
concatenated), remapped once by the unsharded modules, and the rows go back
to their devices. Every device computes the same remap, so admissions,
evictions and rows equal the unsharded module's on the global batch; the ids
are all-gathered (by XLA) and each device holds every managed module's state.
For tables too large for that, TorchRec's per-shard managed collision is
:class:`ShardedManagedCollisionCollection` (a different remap: one module per
input range).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..modules.mc_collection import ManagedCollisionCollection
from ..sparse import KeyedJaggedTensor


class GlobalBatchManagedCollision(nnx.Module):
    """A :class:`ManagedCollisionCollection` applied to a stacked batch as to the global one.

    Args:
        mcc: the unsharded collection (kept, replicated).

    Call it on a stacked KJT (leaves ``[N, ...]``, see ``shard_batch``); it
    returns the stacked KJT of rows (same lengths and weights).
    """

    def __init__(self, mcc: ManagedCollisionCollection):
        if not isinstance(mcc, ManagedCollisionCollection):
            raise TypeError(f"mcc must be a ManagedCollisionCollection, got {type(mcc).__name__}")
        self.mcc = mcc

    @property
    def managed_collision_modules(self):
        return self.mcc.managed_collision_modules

    def embedding_configs(self):
        return self.mcc.embedding_configs()

    def __call__(self, features: KeyedJaggedTensor, *, deterministic: bool | None = None):
        glob, positions = to_global(features)
        rows = self.mcc(glob, deterministic=deterministic).values()
        local = jnp.take(rows, positions, axis=0, mode="clip")  # padding: any row, unread
        return jax.vmap(
            lambda kjt, v: KeyedJaggedTensor.from_parts(
                kjt.keys(),
                v,
                kjt.lengths(),
                kjt.weights_or_none(),
                capacities=kjt.capacity_per_key(),
                stride=kjt.stride(),
            )
        )(features, local)

    def evict(self) -> dict[str, jax.Array]:
        return self.mcc.evict()

    def open_slots(self) -> dict[str, jax.Array]:
        return self.mcc.open_slots()

    def ensure_buffers(self, features: KeyedJaggedTensor) -> None:
        """Allocates the history for the global batch of this stacked KJT (eagerly, once)."""
        self.mcc.ensure_buffers(to_global(features)[0])


def to_global(features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, jax.Array]:
    """The global KJT of a stacked one, and ``[N, C]`` each local entry's global position.

    Key ``k`` of the global KJT has capacity ``N * cap_k`` and stride ``N * B``;
    its ids are every device's ids of ``k`` in device order, then padding (the
    valid ids are a prefix, as a KJT needs). A local padding entry's position
    is out of range.
    """
    if features.values().ndim != 2:
        raise ValueError(
            "features must be stacked per device ([N, ...] leaves, see shard_batch), got "
            f"{features.values().shape=}"
        )
    n, b, keys = features.values().shape[0], features.stride(), features.keys()
    caps, offs = features.capacity_per_key(), features.capacity_offsets()
    lengths = features.lengths().reshape(n, len(keys), b)
    counts = jnp.sum(lengths, axis=2)  # [N, F] ids per device and key
    start = jnp.cumsum(counts, axis=0) - counts  # [N, F] first global slot of each device
    total = sum(caps) * n
    positions = []
    for k, cap in enumerate(caps):
        j = jnp.arange(cap)
        at = n * offs[k] + start[:, k : k + 1] + j  # [N, cap]
        positions.append(jnp.where(j < counts[:, k : k + 1], at, total))
    positions = jnp.concatenate(positions, axis=1)
    values = jnp.zeros((total,), features.values().dtype)
    values = values.at[positions.reshape(-1)].set(features.values().reshape(-1), mode="drop")
    glob = KeyedJaggedTensor.from_parts(
        keys,
        values,
        jnp.transpose(lengths, (1, 0, 2)).reshape(-1),
        None,
        capacities=tuple(n * c for c in caps),
        stride=n * b,
    )
    return glob, positions
