"""Row-wise sharded managed collision (TorchRec's ``ShardedManagedCollisionCollection``).

Each of the ``N`` devices owns one row block of every managed table (rows
``[k * Z/N, (k + 1) * Z/N)``, the blocks of the ``row_wise()`` plan) and an
independent managed-collision module for it, built with
``rebuild_with_output_id_range``. Ids are routed by their *input* range, as in
TorchRec: key ``x`` (after ``input_hash_func``) belongs to shard
``x // ceil(input_hash_size / N)``. So shard ``k`` admits, evicts and remaps
exactly the ids of its input bucket, and the result equals ``N`` unsharded
modules, each fed its bucket's ids of the global batch (in device order). A
row-wise sharded embedding collection then finds every remapped row on the
device whose module produced it, and so do the evicted rows.

Per table, under ``jax.shard_map``::

    local raw ids --keys--> bucket by input range --all_to_all--> shard k's module
        (profile + evict in training, remap) --all_to_all back--> rows at the ids' places

Spread ids over the whole input range (``input_hash_func=hash_ids``, or an
``input_hash_size`` equal to the real id range): unhashed small ids would all
land on the first shards. Invalid ids and padding are not sent; they get the
table's last row (the unsharded miss row). The per-destination capacity is
the table's id capacity per device, so nothing can overflow.
"""

from __future__ import annotations

import functools
import weakref

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..modules.mc_collection import ManagedCollisionCollection, remap_by_table
from ..modules.mc_modules import MCHManagedCollisionModule, MCState
from ..modules.mc_policies import SENTINEL
from ..sparse import KeyedJaggedTensor
from .embedding_dist import local_kjt
from .sharded_base import alive

STATE_FIELDS = (
    "sorted_ids",
    "slots",
    "counts",
    "last_access",
    "current_iter",
    "last_eviction_iter",
    "history_ids",
    "history_iters",
    "history_len",
    "evicted",
)
_EAGER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ShardedManagedCollisionCollection(nnx.Module):
    """A :class:`ManagedCollisionCollection` split row-wise over every device of ``mesh``.

    Args:
        collection: the unsharded collection (its modules' configuration is
            used; their state must still be fresh). Every table's ``zch_size``
            must be a multiple of the mesh size, each block ``>= 2``, and no
            module may use ``mch_size``.
        mesh: the device mesh; all its axes are flattened into ``N`` ranks.
        deterministic: ``True`` = eval mode (remap only), as for the unsharded modules.

    Call it on a stacked KJT (``shard_batch``: leaves ``[N, ...]``, one local
    batch per device); it returns the stacked KJT of rows. :meth:`evict` gives
    per table ``[N, E]`` rows, device ``k``'s in its own block.

    Example:
        >>> smcc = ShardedManagedCollisionCollection(mcc, mesh)
        >>> rows = smcc(shard_batch(local_kjts, mesh))   # then a row_wise() sharded EBC
    """

    def __init__(
        self,
        collection: ManagedCollisionCollection,
        mesh: jax.sharding.Mesh,
        *,
        deterministic: bool = False,
    ):
        if not isinstance(collection, ManagedCollisionCollection):
            raise TypeError(
                f"collection must be a ManagedCollisionCollection, got {type(collection).__name__}"
            )
        self.mesh = mesh
        self.axis = tuple(mesh.axis_names)
        n = mesh.size
        self.configs = tuple(collection.embedding_configs())
        factories = {}
        for c in self.configs:
            mc = collection.managed_collision_modules[c.name]
            if not isinstance(mc, MCHManagedCollisionModule):
                raise TypeError(
                    f"table {c.name!r}: ShardedManagedCollisionCollection shards "
                    f"MCHManagedCollisionModule tables, got {type(mc).__name__} (dynamic "
                    "tables: ShardedHashZchCollection)"
                )
            if mc.mch_size:
                raise NotImplementedError(f"table {c.name!r}: row-wise sharding with mch_size")
            if mc.zch_size % n or mc.zch_size // n < 2:
                size = max(2 * n, -(-mc.zch_size // n) * n)
                raise ValueError(
                    f"table {c.name!r}: zch_size={mc.zch_size} must be a multiple of the {n} "
                    f"shards with at least 2 slots each (e.g. {size})"
                )
            if int(mc.current_iter[...]) != 0:
                raise ValueError(f"table {c.name!r}: shard a fresh module (it was trained already)")
            blk = mc.zch_size // n
            factories[c.name] = tuple(
                functools.partial(mc.rebuild_with_output_id_range, (k * blk, (k + 1) * blk))
                for k in range(n)
            )
        self._factories = factories  # static: shard k's fresh module, rebuilt on demand
        self.deterministic = deterministic  # flax's mode flag (model.train() / model.eval())
        # {table: {field: MCState}}, allocated by ensure_buffers
        self.state: nnx.Dict | None = nnx.data(None)

    # ----- state -----
    def ensure_buffers(self, features: KeyedJaggedTensor) -> None:
        """Allocates every shard's history for this (stacked or local) KJT; eagerly, once."""
        if self.state is not None:
            return
        caps = dict(zip(features.keys(), features.capacity_per_key(), strict=True))
        n = self.mesh.size
        placed = {}
        for c in self.configs:
            per_device = max(sum(caps.get(f, 0) for f in c.feature_names), 1)
            shards = [self._module(c.name, k, per_device) for k in range(n)]
            sharding = NamedSharding(self.mesh, P(self.axis))
            placed[c.name] = nnx.Dict(
                {
                    f: MCState(
                        jax.device_put(jnp.stack([getattr(m, f)[...] for m in shards]), sharding)
                    )
                    for f in STATE_FIELDS
                }
            )
        self.state = nnx.Dict(placed)

    def _module(self, table: str, rank: int, per_device: int) -> MCHManagedCollisionModule:
        """A fresh module for ``table``'s shard ``rank`` (buffers for N x per_device ids)."""
        mc = self._factories[table][rank]()
        mc.ensure_buffers(self.mesh.size * per_device)  # a shard receives from N devices
        return mc

    def shard_state(self, table: str, rank: int) -> dict[str, np.ndarray]:
        """Host copies of the state arrays of ``table``'s module on ``rank``."""
        state = self._need_state()
        return {f: np.asarray(state[table][f][...])[rank] for f in STATE_FIELDS}

    def evict(self) -> dict[str, jax.Array]:
        """Table -> ``[N, E]`` int32 global rows evicted by the latest training call."""
        state = self._need_state()
        return {c.name: state[c.name]["evicted"][...] for c in self.configs}

    def open_slots(self) -> dict[str, jax.Array]:
        """Table -> ``[N]`` free slots per shard."""
        state = self._need_state()
        out = {}
        for c in self.configs:
            ids = state[c.name]["sorted_ids"][...]
            used = jnp.sum(ids != SENTINEL, axis=1, dtype=jnp.int32)
            out[c.name] = ids.shape[1] - 1 - used
        return out

    def _need_state(self) -> nnx.Dict:
        if self.state is None:
            raise ValueError("no state yet: call ensure_buffers(features) or the module once")
        return self.state

    # ----- forward -----
    def __call__(self, features: KeyedJaggedTensor, *, deterministic: bool | None = None):
        """Stacked raw-id KJT -> stacked row KJT (training unless ``deterministic``).

        The first call allocates the state (or :meth:`ensure_buffers`): make it
        eagerly, before ``nnx.split`` / ``init_train_state``.
        """
        deterministic = bool(self.deterministic if deterministic is None else deterministic)
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        missing = sorted({f for c in self.configs for f in c.feature_names} - set(features.keys()))
        if missing:
            raise ValueError(f"features lack the managed keys {missing}")
        if features.values().ndim != 2 or features.values().shape[0] != self.mesh.size:
            raise ValueError(
                f"features must be stacked per device ([{self.mesh.size}, ...] leaves, see "
                f"shard_batch), got {features.values().shape=}"
            )
        self.ensure_buffers(features)
        placed = self._need_state()
        state = {t: {f: v[...] for f, v in d.items()} for t, d in placed.items()}
        run = self._forward if _traced(features) else self._eager(deterministic)
        new_state, out = run(state, features, deterministic)
        for t, d in new_state.items():
            for f, x in d.items():
                placed[t][f][...] = x
        return out

    def _eager(self, deterministic):
        """One compiled program per mode for eager calls (not op-by-op over the mesh)."""
        fns = _EAGER.setdefault(self, {})
        if deterministic not in fns:
            ref = weakref.ref(self)  # the cache must not keep the module alive
            fns[deterministic] = jax.jit(
                lambda s, f, d: alive(ref)._forward(s, f, d), static_argnums=2
            )
        return fns[deterministic]

    def _forward(self, state, features, deterministic):
        spec = P(self.axis)
        return jax.shard_map(
            lambda s, f: self._local(s, f, deterministic),
            mesh=self.mesh,
            in_specs=(spec, spec),
            out_specs=(spec, spec),
            check_vma=False,
        )(state, features)

    def _local(self, state, kjt_stacked, deterministic):
        n = self.mesh.size
        new_state = {}

        def remap(name, flat, valid):
            template = self._module(name, 0, max(flat.shape[0], 1))
            keys = template.keys(flat, valid)
            rows, new_state[name] = self._route(template, state[name], keys, n, deterministic)
            return rows

        out = remap_by_table(local_kjt(kjt_stacked), self.configs, remap)
        return new_state, jax.tree.map(lambda x: x[None], out)

    def _route(self, template, state, keys, n, deterministic):
        """Sends keys to their input bucket's shard, runs its module there, brings rows back."""
        cap = keys.shape[0]
        block = -(-template.input_hash_size // n)
        valid = keys != SENTINEL
        bucket = jnp.where(valid, jnp.minimum(keys // jnp.uint32(block), n - 1), n)
        bucket = bucket.astype(jnp.int32)
        pos = jnp.zeros((cap,), jnp.int32)
        send = []
        for k in range(n):
            mine = bucket == k
            p = jnp.cumsum(mine) - 1
            pos = jnp.where(mine, p, pos)
            at = jnp.where(mine, p, cap)
            send.append(jnp.full((cap,), SENTINEL, jnp.uint32).at[at].set(keys, mode="drop"))
        recv = jax.lax.all_to_all(jnp.stack(send), self.axis, 0, 0, tiled=True)  # [N, cap]

        local = template  # a fresh module of this table: load this device's state into it
        for name in STATE_FIELDS:
            getattr(local, name)[...] = state[name][0]
        flat = recv.reshape(-1)
        local.profile_keys(flat, deterministic=deterministic)
        rows = local.remap_keys(flat).reshape(n, cap)
        back = jax.lax.all_to_all(rows, self.axis, 0, 0, tiled=True)  # [N, cap] by destination
        miss = jnp.int32(n * template.zch_size - 1)
        got = back[jnp.minimum(bucket, n - 1), pos]
        out = jnp.where(valid, got, miss)
        return out, {name: getattr(local, name)[...][None] for name in STATE_FIELDS}


def _traced(kjt: KeyedJaggedTensor) -> bool:
    return isinstance(kjt.values(), jax.core.Tracer)
