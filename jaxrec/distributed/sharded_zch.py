"""Dynamic tables sharded by the id's hash (TorchRec's sharded ``HashZchManagedCollisionModule``).

A dynamic table's index (:mod:`jaxrec.modules.zch_index`) is made of
independent buckets, so it splits row-wise by bucket: of ``N`` devices, shard
``k`` owns global buckets ``[k B/N, (k + 1) B/N)`` (``B`` = the table's
``total_buckets``), which are its rows ``[k Z/N, (k + 1) Z/N)``: exactly the
blocks of a ``row_wise()`` plan of the table, so a row-wise sharded embedding
collection finds every row on the device whose index gave it. An id travels
to the owner of its bucket, is admitted / evicted / looked up there, and its
row comes back. Every decision of the index depends only on the multiset of
ids of each bucket, so the result is exactly that of the unsharded module fed
the global batch (rows, evicted rows, counters, state), while no device sees
the whole batch or holds the whole index.

Per table, under ``jax.shard_map``::

    local ids (lo, hi) --hash64--> global bucket g --> owner k = g // (B/N)
        --all_to_all (lo, hi, valid; N x per-device capacity)--> shard k:
            train_step (training) / remap (eval) on its block of the index
        --all_to_all back (rows)--> rows at the ids' places
    evicted rows of every shard --all_gather--> one replicated list (bucket order)

The owner's block is an index of ``B/N`` buckets in its own right: since
``B/N`` divides ``B``, ``h mod (B/N)`` is ``(h mod B) - k B/N`` for every id of
shard ``k``, so one program (traced once, the shard's row offset added
at run time) serves every shard. The per-destination capacity is the table's
id capacity per device, so nothing can overflow. Rejected, invalid and
padding ids get ``FILL`` (``2**31 - 1``), as unsharded.

State per table: the index's global arrays (``id_lo``, ``id_hi``,
``last_seen``, ``counts`` ``[Z]``, ``sketch`` ``[Z]`` or ``[0]``), sharded
over the slot dim (``NamedSharding(mesh, P(axes))``), and replicated scalars
(``current_iter``, ``occupancy``, the last call's counters summed over shards)
and evicted rows. The variables keep the unsharded module's names and shapes,
none depends on ``N``: a checkpoint restores under any world size that
divides the bucket count.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import jax
import jax.core
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..modules import zch_index as zi
from ..modules.hash_zch import COUNTER_NAMES, EvictedRows, HashZchManagedCollisionModule
from ..modules.mc_collection import ManagedCollisionCollection, remap_by_table
from ..modules.mc_modules import MCState
from ..sparse import KeyedJaggedTensor
from ..sparse.ids64 import id_words
from .embedding_dist import local_kjt
from .sharded_base import alive
from .sharding_plan import row_wise
from .types import ShardingType

SLOT_FIELDS = ("id_lo", "id_hi", "last_seen", "counts", "sketch")  # [Z] (sketch [Z] or [0])
SCALAR_FIELDS = ("current_iter", "occupancy", "last_counts")  # replicated
_EAGER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shard_blocks(zch_size: int, world_size: int) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each shard: ``world_size`` equal blocks."""
    blk = zch_size // world_size
    return [(k * blk, blk) for k in range(world_size)]


def check_shardable(name: str, module: HashZchManagedCollisionModule, world_size: int) -> None:
    """Raises unless ``module`` (a whole table's index) splits into ``world_size`` blocks of
    whole buckets, one per shard."""
    lay = module.layout
    if lay.bucket_offset or module.output_global_offset or lay.buckets != lay.total_buckets:
        raise ValueError(
            f"table {name!r}: shard the whole table's module (got buckets "
            f"[{lay.bucket_offset}, {lay.bucket_offset + lay.buckets}) of {lay.total_buckets}, "
            f"output_global_offset={module.output_global_offset}); build it with "
            "total_num_buckets=None (zch_size // ways) and output_global_offset=0"
        )
    if lay.total_buckets % world_size:
        b = -(-lay.total_buckets // world_size) * world_size
        raise ValueError(
            f"table {name!r}: its {lay.total_buckets} buckets (zch_size={module.zch_size} / "
            f"ways={lay.ways}) must split evenly over the {world_size} shards: make zch_size a "
            f"multiple of ways * {world_size} (e.g. {b * lay.ways})"
        )


def check_row_wise_plan(name: str, zch_size: int, sharding, world_size: int) -> None:
    """Raises unless ``sharding`` (a table's ``ParameterSharding``) is row-wise with block
    ``k`` (rows ``[k Z/N, (k + 1) Z/N)``) on rank ``k``: the index's own blocks."""
    kind = getattr(sharding, "sharding_type", None)
    if kind is not ShardingType.ROW_WISE:
        got = getattr(kind, "value", kind)
        raise ValueError(
            f"table {name!r} is a dynamic table (HashZchManagedCollisionModule): its index is "
            f"sharded row-wise by the id's hash, so plan the table row-wise "
            f"(jaxrec.distributed.row_wise()), not {got!r}"
        )
    blocks = sorted(
        (s.placement, s.shard_offsets[0], s.shard_sizes[0])
        for s in sharding.sharding_spec
        if s.shard_sizes[0]
    )
    want = [(k, r0, nr) for k, (r0, nr) in enumerate(shard_blocks(zch_size, world_size))]
    if blocks != want:
        raise ValueError(
            f"table {name!r}: its row-wise blocks (rank, first row, rows) {blocks} must be the "
            f"index's blocks {want}: use row_wise() over every rank, in rank order"
        )


class ShardedHashZchTable(nnx.Module):
    """One dynamic table's index over a mesh: the unsharded module's variables, global
    arrays with the slot dim sharded (see the module docs).

    Args:
        module: the unsharded module (its configuration and current state are taken).
        mesh: the device mesh (all axes flattened into ``N`` ranks).
        deterministic: ``True`` = eval (lookup only); ``None`` keeps the module's flag.
    """

    # SLOT_FIELDS and SCALAR_FIELDS, set by name in __init__
    id_lo: MCState
    id_hi: MCState
    last_seen: MCState
    counts: MCState
    sketch: MCState
    current_iter: MCState
    occupancy: MCState
    last_counts: MCState
    evicted: EvictedRows | None  # allocated by ensure_buffers unless the module had one

    def __init__(
        self,
        module: HashZchManagedCollisionModule,
        mesh: jax.sharding.Mesh,
        *,
        deterministic: bool | None = None,
    ):
        axes = tuple(mesh.axis_names)
        self.layout = module.layout
        self.zch_size = module.zch_size
        self.world_size = mesh.size
        self.deterministic = module.deterministic if deterministic is None else deterministic
        slots = NamedSharding(mesh, P(axes))
        repl = NamedSharding(mesh, P())
        # own buffers: a module's fields may share one (its zero scalars), and a train step
        # donates each variable's buffer (device_put keeps device 0's, even with may_alias=False)
        for f in SLOT_FIELDS:  # (an empty sketch is replicated: shard_map returns it so)
            x = getattr(module, f)[...]
            setattr(self, f, MCState(_placed(x, slots if x.shape[0] else repl)))
        for f in SCALAR_FIELDS:
            setattr(self, f, MCState(_placed(getattr(module, f)[...], repl)))
        self.evicted = nnx.data(None)
        if module.evicted is not None:
            self.evicted = EvictedRows(_placed(module.evicted[...], repl))
        self._replicated = repl

    def local_layout(self) -> zi.ZchLayout:
        """The layout every shard's block runs under: ``B/N`` buckets, row offset 0 (the
        shard's offset is added at run time, see the module docs)."""
        lay, n = self.layout, self.world_size
        return zi.ZchLayout(
            slots=lay.slots // n,
            ways=lay.ways,
            total_buckets=lay.total_buckets // n,
            seed=lay.seed,
            eviction=lay.eviction,
            admission=lay.admission,
        )

    def output_size(self) -> int:
        return self.zch_size

    def is_training(self, deterministic: bool | None = None) -> bool:
        return not bool(self.deterministic if deterministic is None else deterministic)

    @property
    def max_evictions(self) -> int:
        return self._evicted().shape[0]

    def _evicted(self) -> EvictedRows:
        if self.evicted is None:
            raise ValueError(
                "no eviction buffer yet: call ensure_buffers(stacked_batch) (or the collection "
                "once, eagerly) first, or build the module with max_evictions=..."
            )
        return self.evicted

    def ensure_buffers(self, global_capacity: int) -> None:
        """Allocates :meth:`evict`'s buffer for global batches of ``global_capacity`` ids (the
        unsharded module's size for that batch: ``min(capacity, zch_size)``)."""
        if self.evicted is None:
            e = max(min(global_capacity, self.zch_size), 1)
            self.evicted = EvictedRows(
                jax.device_put(jnp.full((e,), zi.FILL, jnp.int32), self._replicated)
            )

    def evict(self) -> jax.Array:
        """``[max_evictions]`` int32 global rows evicted by the latest training call, of
        every shard, in bucket order (``FILL``-padded): the unsharded module's list."""
        return self._evicted()[...]  # (raises without buffers)

    def open_slots(self) -> jax.Array:
        return jnp.int32(self.zch_size) - self.occupancy[...]

    def counters(self) -> dict[str, jax.Array]:
        """The latest training call's counters (summed over shards) and the occupancy."""
        c = self.last_counts[...]
        return {**dict(zip(COUNTER_NAMES, c, strict=True)), "occupancy": self.occupancy[...]}


class ShardedHashZchCollection(nnx.Module):
    """A :class:`ManagedCollisionCollection` of dynamic tables, sharded by the id's hash.

    Args:
        collection: the unsharded collection; every module a
            :class:`~jaxrec.modules.HashZchManagedCollisionModule` of a whole
            table whose bucket count is a multiple of the mesh size. Its
            modules' configuration and state are copied (sharded).
        mesh: the device mesh; all its axes are flattened into ``N`` ranks.
        deterministic: ``True`` = eval mode (lookups only), ``False`` = training;
            ``None`` (default) keeps each module's flag.

    Call it on a stacked KJT (``shard_batch``: leaves ``[N, ...]``, plain ids
    or id words); it returns the stacked KJT of rows. :meth:`evict` gives per
    table the evicted global rows of all shards, replicated, as the unsharded
    module gives them for the global batch; pass them to a sharded
    collection's ``reset_table_rows``. Its tables are
    ``managed_collision_modules`` (``ShardedHashZchTable`` s).

    Example:
        >>> smcc = ShardedHashZchCollection(mcc, mesh)
        >>> smcc.ensure_buffers(shard_batch(local_kjts, mesh))
        >>> rows = smcc(shard_batch(local_kjts, mesh))   # then a row_wise() sharded EBC
    """

    def __init__(
        self,
        collection: ManagedCollisionCollection,
        mesh: jax.sharding.Mesh,
        *,
        deterministic: bool | None = None,
    ):
        if not isinstance(collection, ManagedCollisionCollection):
            raise TypeError(
                f"collection must be a ManagedCollisionCollection, got {type(collection).__name__}"
            )
        modules = {
            n: m
            for n, m in collection.managed_collision_modules.items()
            if isinstance(m, HashZchManagedCollisionModule)
        }
        other = sorted(set(collection.managed_collision_modules) - set(modules))
        if other:
            raise TypeError(
                f"ShardedHashZchCollection shards dynamic tables only; tables {other} have "
                "other modules (MCHManagedCollisionModule: ShardedManagedCollisionCollection)"
            )
        self.mesh = mesh
        self.axis = tuple(mesh.axis_names)
        self.configs = tuple(collection.embedding_configs())
        for c in self.configs:
            check_shardable(c.name, modules[c.name], mesh.size)
            # the index's blocks are the row-wise plan's (as layout.py cuts them)
            check_row_wise_plan(c.name, c.num_embeddings, row_wise()(c, mesh.size, 1), mesh.size)
        self.managed_collision_modules = nnx.Dict(
            {
                c.name: ShardedHashZchTable(modules[c.name], mesh, deterministic=deterministic)
                for c in self.configs
            }
        )

    def embedding_configs(self) -> list:
        return list(self.configs)

    # ----- buffers and readouts -----
    def ensure_buffers(self, features: KeyedJaggedTensor) -> None:
        """Allocates the evicted-row buffers for this stacked KJT (eagerly, once)."""
        caps = dict(zip(features.keys(), features.capacity_per_key(), strict=True))
        for c in self.configs:
            per_device = sum(caps.get(f, 0) for f in c.feature_names)
            self.managed_collision_modules[c.name].ensure_buffers(self.mesh.size * per_device)

    def evict(self) -> dict[str, jax.Array]:
        """Table -> ``[E]`` int32 global rows evicted by the latest training call (replicated)."""
        return {n: t.evict() for n, t in self.managed_collision_modules.items()}

    def open_slots(self) -> dict[str, jax.Array]:
        return {n: t.open_slots() for n, t in self.managed_collision_modules.items()}

    def counters(self) -> dict[str, dict[str, jax.Array]]:
        return {n: t.counters() for n, t in self.managed_collision_modules.items()}

    # ----- forward -----
    def __call__(self, features: KeyedJaggedTensor, *, deterministic: bool | None = None):
        """Stacked raw-id KJT -> stacked row KJT (training unless ``deterministic``)."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        missing = sorted({f for c in self.configs for f in c.feature_names} - set(features.keys()))
        if missing:
            raise ValueError(f"features lack the managed keys {missing}")
        shape = features.values().shape
        if len(shape) not in (2, 3) or shape[0] != self.mesh.size:
            raise ValueError(
                f"features must be stacked per device ([{self.mesh.size}, ...] leaves, see "
                f"shard_batch), got {features.values().shape=}"
            )
        self.ensure_buffers(features)
        tables = self.managed_collision_modules
        train = tuple(tables[c.name].is_training(deterministic) for c in self.configs)
        state = {
            n: {f: getattr(t, f)[...] for f in (*SLOT_FIELDS, *SCALAR_FIELDS, "evicted")}
            for n, t in tables.items()
        }
        run = self._forward if isinstance(features.values(), jax.core.Tracer) else self._eager()
        new_state, out = run(state, features, train)
        for n, d in new_state.items():
            for f, x in d.items():
                getattr(tables[n], f)[...] = x
        return out

    def _eager(self):
        """One compiled program per mode for eager calls (not op-by-op over the mesh)."""
        if self not in _EAGER:
            ref = weakref.ref(self)  # the cache must not keep the module alive
            _EAGER[self] = jax.jit(lambda s, f, t: alive(ref)._forward(s, f, t), static_argnums=2)
        return _EAGER[self]

    def _forward(self, state, features, train):
        spec = P(self.axis)
        specs = {
            n: {f: (spec if f in SLOT_FIELDS and x.shape[0] else P()) for f, x in d.items()}
            for n, d in state.items()
        }
        return jax.shard_map(
            lambda s, f: self._local(s, f, train),
            mesh=self.mesh,
            in_specs=(specs, spec),
            out_specs=(specs, spec),
            check_vma=False,
        )(state, features)

    def _local(self, state, kjt_stacked, train):
        modes = dict(zip((c.name for c in self.configs), train, strict=True))
        new_state = {}

        def remap(name, flat, valid):
            rows, new_state[name] = self._route(name, state[name], flat, valid, modes[name])
            return rows

        out = remap_by_table(local_kjt(kjt_stacked), self.configs, remap)
        return new_state, jax.tree.map(lambda x: x[None], out)

    def _route(self, name, state, flat, valid, training):
        """Sends ids to their bucket's shard, runs its block there, brings rows back."""
        table = self.managed_collision_modules[name]
        n, axis, layout, local = self.mesh.size, self.axis, table.layout, table.local_layout()
        lo, hi = id_words(flat)
        cap = lo.shape[0]
        g, _ = zi.buckets_of(layout, lo, hi)
        dest = jnp.where(valid, g // (layout.total_buckets // n), n)  # n: not sent
        mine = dest[:, None] == jnp.arange(n, dtype=dest.dtype)  # [cap, n]
        pos = jnp.sum(jnp.where(mine, jnp.cumsum(mine, axis=0, dtype=jnp.int32) - 1, 0), axis=1)

        def send(x, fill):  # [n, cap] by destination, all_to_all'd
            buf = jnp.full((n, cap), fill, x.dtype).at[dest, pos].set(x, mode="drop")
            return jax.lax.all_to_all(buf, axis, 0, 0, tiled=True).reshape(-1)

        r_lo, r_hi, r_ok = send(lo, 0), send(hi, 0), send(valid, False)
        row0 = jax.lax.axis_index(axis).astype(jnp.int32) * jnp.int32(local.slots)
        block = zi.ZchState(  # the block's occupancy counts this call's change only
            id_lo=state["id_lo"],
            id_hi=state["id_hi"],
            last_seen=state["last_seen"],
            counts=state["counts"],
            sketch=state["sketch"],
            current_iter=state["current_iter"],
            occupancy=jnp.zeros((), jnp.int32),
        )
        new = dict(state)
        if training:
            e = max(min(table.max_evictions, n * cap, local.slots), 1)
            step = zi.train_step(local, block, r_lo, r_hi, r_ok, max_evictions=e)
            rows = step.rows
            evicted = jax.lax.all_gather(_shift(step.evicted, row0), axis, tiled=True)  # [n e]
            (at,) = jnp.nonzero(evicted != zi.FILL, size=table.max_evictions, fill_value=n * e)
            new.update({f: getattr(step.state, f) for f in SLOT_FIELDS})
            new["current_iter"] = step.state.current_iter
            new["occupancy"] = state["occupancy"] + jax.lax.psum(step.state.occupancy, axis)
            new["last_counts"] = jax.lax.psum(jnp.stack(list(step.counts)), axis)
            new["evicted"] = evicted.at[at].get(mode="fill", fill_value=zi.FILL)
        else:
            rows = zi.remap(local, block, r_lo, r_hi, r_ok)
        back = jax.lax.all_to_all(_shift(rows, row0).reshape(n, cap), axis, 0, 0, tiled=True)
        got = back[jnp.minimum(dest, n - 1), pos]
        return jnp.where(dest < n, got, zi.FILL).astype(jnp.int32), new


def _placed(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` on ``sharding`` in buffers of its own."""
    return jax.device_put(jnp.copy(x), sharding)


def _shift(rows: jax.Array, offset: jax.Array) -> jax.Array:
    """Block rows -> global rows (``FILL`` stays)."""
    return jnp.where(rows == zi.FILL, zi.FILL, rows + offset).astype(jnp.int32)


def is_dynamic(collection: ManagedCollisionCollection) -> bool:
    """Whether every module of ``collection`` is a dynamic table's (raises when mixed)."""
    modules: Mapping = collection.managed_collision_modules
    dyn = {n for n, m in modules.items() if isinstance(m, HashZchManagedCollisionModule)}
    if dyn and len(dyn) != len(modules):
        raise ValueError(
            f"a managed-collision collection mixes dynamic tables {sorted(dyn)} "
            f"(HashZchManagedCollisionModule) with tables {sorted(set(modules) - dyn)} of other "
            "modules; DistributedModelParallel shards the dynamic ones by the id's hash and "
            "remaps the others on the global batch: put them in two collections"
        )
    return bool(dyn)
