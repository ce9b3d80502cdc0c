"""What sharded pooled and sequence collections share: placement, state, the fused update.

``ShardedCollection`` runs the three stages of ``embedding_dist`` under
``shard_map`` and the fused optimizer on the local shards. Its two abstract
kinds say how a width group's lookups come home and how their gradients go
out: ``PooledShardedCollection`` (pooled on the shard's rank, partial sums sent
back; a subclass adds them with ``_add_group`` and reads gradients with
``_group_grads``) and ``SequenceShardedCollection`` (one row per id sent back;
``_add_block`` / ``_read_block`` per slot). A concrete subclass also says how
one device's output looks (``_new_output``), how replicated (data-parallel)
tables are looked up and differentiated, and how the output is returned; one
that leaves a hook out cannot be instantiated (``abc``: ``TypeError`` naming it).
"""

from __future__ import annotations

import abc
import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, TypedDict, TypeVar

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from ..configs import BaseEmbeddingConfig
from ..embedding.blocks import Block, TableBlocks
from ..embedding.collection import EmbeddingCollectionInterface, PlanLocal
from ..embedding.optimizer import SubGroup, state_key
from ..embedding.sparse_update import update_subgroup
from ..embedding.tables import EmbeddingTable, TableGroup, group_tables
from ..embedding.tape import log_overflow, report_overflow, tap
from ..ops import Implementation, embedding_bag, embedding_gather
from ..optim.base import apply_rows
from ..xla.backward import dedup_rows
from ..xla.bounds import BoundsCheckMode, collect_checks, report_out_of_range
from . import embedding_dist as dist
from . import exchange, input_dist, sharded_reset
from .capacity import (
    CAPACITY_FACTOR,
    check_capacity,
    group_capacity,
    measured_loads,
    natural_load,
)
from .exact_update import exact_update, logical_rows
from .host_copies import cast, host_float32, logical_tables
from .id_checks import check_sharded_ids
from .layout import BufferKey, WidthGroup, build_layout
from .qcomms import FP32_COMMS, QCommsConfig
from .row_sums import column_split_row_sum, peer_schedule
from .shard_init import check_drawable, draw_groups, draw_replicated
from .types import ParameterSharding

# "exact": ids beyond the fast path take extra exchange rounds (counted in
# overflow_count). The others drop them (counted) and raise after the step,
# warn, or only count: an explicit opt-in.
OVERFLOW_MODES = ("exact", "raise", "warn", "count")
_EAGER_FORWARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# A logical table as state dicts hold it: a device array or a host copy.
HostOrDevice = jax.Array | np.ndarray


class ShardSource(Protocol):
    """What a sharded collection reads of the unsharded collection it shards (a float
    or a quantized one; maybe abstract, from ``nnx.eval_shape``)."""

    @property
    def table_configs(self) -> tuple[BaseEmbeddingConfig, ...]: ...
    @property
    def prefix(self) -> str: ...
    @property
    def bounds_check_mode(self) -> BoundsCheckMode: ...
    @property
    def implementation(self) -> Implementation: ...
    @property
    def dtype(self) -> DTypeLike: ...  # the output dtype
    @property
    def embedding_names(self) -> tuple[str, ...]: ...
    def state_dict(self) -> Mapping[str, HostOrDevice]: ...  # {"<prefix>.<table>.weight": rows}


class ShardOptions(TypedDict, total=False):
    """The keyword options of a sharded collection (see ``ShardedEmbeddingBagCollection``)."""

    capacity: int | Mapping[str, int] | None
    overflow: str
    pooling_factors: Mapping[str, float] | None
    capacity_factor: float
    qcomms: QCommsConfig | None
    exchange: str
    init_key: jax.Array | None


class CheckSite(NamedTuple):
    """One bounds check collected inside ``shard_map``: its mode, where it is, and its
    example id's dtype name (examples are stacked per dtype)."""

    mode: BoundsCheckMode
    where: str
    dtype: str


_T = TypeVar("_T")


def alive(ref: weakref.ReferenceType[_T]) -> _T:
    """The object of ``ref``; an eager-forward cache entry only runs while its module
    lives (the caches are weak-keyed by it)."""
    obj = ref()
    assert obj is not None, "a cached eager forward outlived its module"
    return obj


class OverflowCount(PlanLocal):
    """Ids beyond the fast-path capacity, per device, since construction: sent in extra
    rounds (``overflow="exact"``) or dropped (the drop modes)."""


class ShardedCollection(EmbeddingCollectionInterface):
    """Base of the sharded collections (see their docstrings for the arguments)."""

    sequence = False  # the exchange's form: one output row per id instead of per bag
    vbe = False  # takes a variable batch per key (pooled collections that expand it)
    mesh: jax.sharding.Mesh  # (the interface's, never None here)

    def __init__(
        self,
        module: ShardSource,
        plan: Mapping[str, ParameterSharding],
        mesh: jax.sharding.Mesh,
        *,
        capacity: int | Mapping[str, int] | None = None,
        overflow: str = "exact",
        pooling_factors: Mapping[str, float] | None = None,
        capacity_factor: float = CAPACITY_FACTOR,
        qcomms: QCommsConfig | None = None,
        exchange: str = "padded",
        init_key: jax.Array | None = None,
    ):
        if overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
        check_capacity(capacity)
        if not capacity_factor >= 1:
            raise ValueError(f"capacity_factor must be >= 1, got {capacity_factor!r}")
        if exchange not in ("padded", "ragged"):
            raise ValueError(f"exchange must be 'padded' or 'ragged', got {exchange!r}")
        if qcomms is not None and not isinstance(qcomms, QCommsConfig):
            raise TypeError(f"qcomms must be a QCommsConfig or None, got {type(qcomms).__name__}")
        self.table_configs = module.table_configs
        self.prefix = module.prefix
        self.layout = build_layout(self.table_configs, plan, mesh.size)
        self.plan = dict(plan)
        self.mesh = mesh
        self.axis = tuple(mesh.axis_names)
        self.bounds_check_mode = module.bounds_check_mode
        self.implementation = module.implementation
        self.dtype = module.dtype
        self.embedding_names = module.embedding_names
        self.capacity = capacity
        self.overflow_mode = overflow
        self.pooling_factors = dict(pooling_factors or {})
        self.capacity_factor = capacity_factor
        self.qcomms = qcomms or FP32_COMMS
        self.exchange = exchange
        features = {f for t in self.table_configs for f in t.feature_names}
        unknown = sorted(set(self.pooling_factors) - features)
        if unknown:
            raise ValueError(f"pooling_factors name unknown features {unknown}")
        bad = {k: v for k, v in self.pooling_factors.items() if not v > 0}
        if bad:
            raise ValueError(f"pooling_factors must be positive (mean ids per bag), got {bad}")
        dims = {t.name: t.embedding_dim for t in self.table_configs}
        self._column_split = {
            g.name for g in self.layout.groups if any(g.ncols < dims[t] for t in g.tables)
        }
        groups = {g.name for g in self.layout.groups}
        if isinstance(capacity, Mapping) and set(capacity) - groups:
            raise ValueError(
                f"capacity names unknown width groups {sorted(set(capacity) - groups)}; "
                f"this collection's are {sorted(groups)}"
            )
        dp = [t for t in self.table_configs if t.name in self.layout.replicated]
        self.replicated_groups = group_tables(dp) if dp else ()
        keys = [BufferKey(g.name) for g in self.layout.groups]
        keys += [BufferKey(rg.name, replicated=True) for rg in self.replicated_groups]
        self.buffers = {k.name: k for k in keys}  # the weight buffers by name
        if init_key is None:  # the module's tables, copied shard by shard
            self.weights = nnx.Dict(self._place(logical_tables(module)))
        else:  # drawn where they live (the module may be abstract: nnx.eval_shape)
            self.weights = nnx.Dict(self._draw(init_key))
        self.overflow_count = OverflowCount(
            jax.device_put(jnp.zeros((mesh.size,), jnp.int32), self._sharded(P(self.axis)))
        )

    # ----- subclass hooks -----
    def _weighted(self) -> bool:
        return False

    @abc.abstractmethod
    def _new_output(self, kjt) -> list:
        """This device's zero output, a list the lookups add to."""

    @abc.abstractmethod
    def _read_block(self, g, kjt, slot, ncols, b) -> jax.Array:
        """``slot``'s ``ncols`` columns of the local output gradient ``g``."""

    @abc.abstractmethod
    def _dp_lookup(self, table, kjt, rg, out) -> None:
        """Adds replicated group ``rg``'s lookups (of its whole ``table``) to ``out``."""

    @abc.abstractmethod
    def _dp_row_grads(self, g, kjt, rg) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(rows, grads, valid)`` of replicated group ``rg`` from the local output
        gradient ``g`` (gathered from every device by the caller)."""

    @abc.abstractmethod
    def _finish(self, values, features) -> Any:
        """The collection's output from the devices' stacked output ``values``."""

    @abc.abstractmethod
    def _forward_group(self, table, kjt, g, spec, box, n_rounds, out) -> list:
        """Adds one width group's lookups (every round) to the output list ``out``."""

    @abc.abstractmethod
    def _row_grads(self, kjt, g, spec, box, g_local) -> tuple[tuple, Callable]:
        """Round 0's ``(rows, grads, valid)`` of group ``g``, and ``more(r) -> (rows, valid,
        grads)`` of round ``r`` (``grads`` a function: sequence gradients travel only when
        called)."""

    # ----- placement and logical views -----
    @staticmethod
    def dp_buffer(rg) -> str:
        """The name of replicated table group ``rg``'s buffer (a key of ``weights``)."""
        return BufferKey(rg.name, replicated=True).name

    def _sharded(self, spec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def config(self, name):
        """The config of table ``name``."""
        return next(t for t in self.table_configs if t.name == name)

    def _place(self, state_dict: Mapping[str, HostOrDevice]) -> dict:
        logical = {t.name: state_dict[f"{self.prefix}.{t.name}.weight"] for t in self.table_configs}
        # Traced (jax.eval_shape / jit: a model built without allocating it): jnp ops.
        traced = any(isinstance(x, jax.core.Tracer) for x in logical.values())
        xp = jnp if traced else np
        if not traced:
            logical = {k: np.asarray(v) for k, v in logical.items()}
        out = {}
        n = self.layout.world_size
        for g in self.layout.groups:
            dtype = self.config(g.tables[0]).dtype
            shape = (n * g.rows_per_rank, g.ncols)
            buf = jnp.zeros(shape, np.float32) if traced else np.zeros(shape, np.float32)
            for rank, shards in enumerate(g.shards):
                for s in shards:
                    start, nr = rank * g.rows_per_rank + s.local_offset, s.nrows
                    w = g.width(s.table, s.row0, s.col0)  # zero-padded up to g.ncols
                    block = logical[s.table][s.row0 : s.row0 + nr, s.col0 : s.col0 + w]
                    if isinstance(buf, jax.Array):  # traced
                        buf = buf.at[start : start + nr, :w].set(block.astype(np.float32))
                    else:
                        buf[start : start + nr, :w] = block
            spec = self._sharded(P(self.axis))
            out[g.name] = EmbeddingTable(jax.device_put(cast(buf, dtype), spec))
        for rg in self.replicated_groups:
            buf = xp.concatenate([logical[t] for t in rg.tables])
            dtype = self.config(rg.tables[0]).dtype
            spec = self._sharded(P())
            out[self.dp_buffer(rg)] = EmbeddingTable(jax.device_put(cast(buf, dtype), spec))
        return out

    def _draw(self, key: jax.Array) -> dict:
        """Every buffer drawn from the collection's init ``key``, each device drawing its
        own shards: the values the unsharded collection built from ``key`` has."""
        check_drawable(self.table_configs)
        configs = {t.name: t for t in self.table_configs}
        streams = {t.name: i for i, t in enumerate(self.table_configs)}
        groups = self.layout.groups
        drawn = draw_groups(groups, configs, streams, self.mesh, key)
        out = {g.name: EmbeddingTable(x) for g, x in zip(groups, drawn, strict=True)}
        for rg in self.replicated_groups:
            out[self.dp_buffer(rg)] = EmbeddingTable(
                draw_replicated(rg, configs, streams, self.mesh, key)
            )
        return out

    def state_dict(self) -> dict[str, jax.Array]:
        """Logical ``{"<prefix>.<table>.weight": [num_embeddings, dim]}`` tables."""
        logical = {
            t.name: np.zeros((t.num_embeddings, t.embedding_dim), np.float32)
            for t in self.table_configs
        }
        for g in self.layout.groups:
            buf = host_float32(self.weights[g.name].get_value())
            for rank, shards in enumerate(g.shards):
                for s in shards:
                    start, nr = rank * g.rows_per_rank + s.local_offset, s.nrows
                    w = g.width(s.table, s.row0, s.col0)
                    rows = buf[start : start + nr, :w]
                    logical[s.table][s.row0 : s.row0 + nr, s.col0 : s.col0 + w] = rows
        for rg in self.replicated_groups:
            buf = host_float32(self.weights[self.dp_buffer(rg)].get_value())
            for t, lo in zip(rg.tables, rg.row_offsets, strict=True):
                logical[t] = buf[lo : lo + self.config(t).num_embeddings]
        return {
            f"{self.prefix}.{t.name}.weight": jax.device_put(cast(logical[t.name], t.dtype))
            for t in self.table_configs
        }

    def load_state_dict(self, state_dict: Mapping[str, HostOrDevice]) -> None:
        expected = {f"{self.prefix}.{t.name}.weight" for t in self.table_configs}
        if set(state_dict) != expected:
            raise ValueError(
                f"load_state_dict: expected exactly {sorted(expected)}, got {sorted(state_dict)}"
            )
        for name, var in self._place(state_dict).items():
            self.weights[name].set_value(var.get_value())

    # ----- forward -----
    def _specs(self):
        return {n: P() if self.buffers[n].replicated else P(self.axis) for n in self.weights}

    @property
    def exact(self) -> bool:
        return self.overflow_mode == "exact"

    def _capacity(self, kjt, group: WidthGroup) -> int:
        """The group's fast-path ids per destination for this batch's key capacities.

        In the drop modes a group holding column shards never drops (its natural
        payload): its shards' row-wise state must see the same ids on every peer.
        """
        caps = dict(zip(kjt.keys(), kjt.capacity_per_key(), strict=True))
        if not self.exact and group.name in self._column_split:
            return natural_load(caps, group.slots)
        stride = kjt.stride()
        if kjt.variable_stride_per_key():  # a user feature's load follows its B_k
            stride = dict(zip(kjt.keys(), kjt.stride_per_key(), strict=True))
        return group_capacity(
            caps,
            stride,
            group,
            capacity=self.capacity,
            pooling_factors=self.pooling_factors,
            factor=self.capacity_factor,
        )

    def capacities(self, features) -> dict[str, int]:
        """``{width group: fast-path ids per destination}`` for a batch like ``features``
        (a local or a stacked KJT: only its keys, capacities and stride are read)."""
        return {g.name: self._capacity(features, g) for g in self.layout.groups}

    def measure_capacities(self, batches, factor: float = CAPACITY_FACTOR) -> dict[str, int]:
        """``{width group: capacity}`` from measured loads: ``factor`` times the most ids
        any local batch of ``batches`` sends one destination (at most the natural payload).

        The measured id statistics for skewed ids (hot rows on one row-wise shard),
        which pooling factors cannot see. ``batches``: host KJTs, one device's batch
        each (such as ``shard_batch``'s inputs). Pass the result as ``capacity=``.
        """
        kjts = list(batches)
        if not kjts:
            raise ValueError("measure_capacities needs at least one local batch")
        out = {}
        for g in self.layout.groups:
            peak = max(max(measured_loads(g, k)) for k in kjts)
            caps = dict(zip(kjts[0].keys(), kjts[0].capacity_per_key(), strict=True))
            natural = natural_load(caps, g.slots)
            out[g.name] = max(1, min(natural, math.ceil(factor * peak)))
        return out

    def _exchanges(self, kjt, pre=None) -> list[tuple[WidthGroup, exchange.Spec, exchange.Outbox]]:
        out = []
        for g in self.layout.groups:
            spec = exchange.Spec(
                n=self.layout.world_size,
                capacity=self._capacity(kjt, g),
                slots=g.max_slots,
                bags=0 if self.sequence else kjt.stride(),
                fill=g.rows_per_rank,
                weighted=self._weighted(),
                sequence=self.sequence,
                ragged=self.exchange == "ragged",
                vbe_bags=_vbe_bags(kjt, g) if kjt.variable_stride_per_key() else None,
            )
            box = input_dist.attach(exchange.outbox(kjt, g, spec), spec, pre, g.name)
            out.append((g, spec, box))
        return out

    def _rounds(self, plans) -> tuple[list[jax.Array | None], jax.Array]:
        """Rounds per group (the same on every device) and this device's ids beyond round 0."""
        beyond = sum(exchange.beyond(box.counts, spec.capacity) for _, spec, box in plans)
        if not self.exact or not plans:
            return [None] * len(plans), jnp.asarray(beyond, jnp.int32)
        mine = jnp.stack([exchange.rounds_needed(box.counts, s.capacity) for _, s, box in plans])
        rounds = jax.lax.pmax(mine, self.axis)
        return [rounds[i] for i in range(len(plans))], jnp.asarray(beyond, jnp.int32)

    def _first_round(self, spec, box):
        got = box.ahead  # sent by the previous step (a pipelined step), else now
        if got is None:
            got = exchange.send(box, spec, 0, self.axis, first=True)
        return exchange.receive(got, spec, 0, None, first=True)

    def _round(self, spec, box, bag_counts, r):
        got = exchange.send(box, spec, r, self.axis, first=False)
        return exchange.receive(got, spec, r, bag_counts, first=False)[0]

    def _forward(self, tables, features):
        wheres: list[CheckSite] = []

        def local(tables, kjt_stacked):
            # Checks collected here report again out here (summed over devices):
            # per-device counts cannot leave shard_map through a train step's
            # collector (see jaxrec.xla.bounds.collect_checks). WARNING checks are
            # collected only when the caller collects them (a train step).
            with collect_checks() as checks:
                values, overflow = self._forward_local(tables, kjt_stacked)
            found = checks.by_mode()
            wheres.extend(
                CheckSite(mode, r.where, jnp.dtype(r.example.dtype).name) for mode, r in found
            )
            return values, overflow, _stack_checks([r for _, r in found])

        values, overflow, (counts, examples) = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(self._specs(), P(self.axis)),
            out_specs=(P(self.axis), P(self.axis), P(self.axis)),
            check_vma=False,
        )(tables, features)
        # Every check's count summed and a bad id of any device, in one all-reduce
        # per array (not one gather per check: a model has a check per feature).
        bad = counts > 0
        totals = jnp.sum(counts, axis=0)
        picked = {}
        for dt, ex in examples.items():
            idx = [k for k, w in enumerate(wheres) if w.dtype == dt]
            best = jnp.max(jnp.where(bad[:, idx], ex, _lowest(ex.dtype)), axis=0)
            picked.update((k, best[i]) for i, k in enumerate(idx))
        for k, site in enumerate(wheres):
            report_out_of_range(totals[k], picked[k], site.mode, site.where)
        return values, overflow

    def __call__(self, features):
        features = features.narrow_ids()  # id words -> int32 rows; wide ids out of range
        if features.variable_stride_per_key() and (not self.vbe or self.exchange == "ragged"):
            features.require_uniform_stride(
                f"{type(self).__name__}" + (" with exchange='ragged'" if self.vbe else "")
            )
        if input_dist.is_recording():  # a pipelined step distributing the next batch
            return input_dist.record(self, features)
        kjt, features = features, input_dist.fed(self, features)  # + ids sent ahead, if any
        tables = {name: v.get_value() for name, v in self.weights.items()}
        if isinstance(jax.tree.leaves(features)[0], jax.core.Tracer):
            values, overflow = self._forward(tables, features)
        else:  # eager: one compiled program instead of op-by-op dispatch over the mesh
            fn = _EAGER_FORWARD.get(self)
            if fn is None:
                ref = weakref.ref(self)  # the cache must not keep the module alive
                fn = _EAGER_FORWARD.setdefault(
                    self, jax.jit(lambda t, f: alive(ref)._forward(t, f))
                )
            values, overflow = fn(tables, features)
        total = jnp.sum(overflow)
        # A train step takes the count: it raises on drops ("raise") or returns it for
        # the host to log ("warn": dropped, "exact": extra rounds). Elsewhere they log
        # from one host callback, only when ids overflowed. "count" only counts.
        mode = self.overflow_mode
        if mode != "count" and not report_overflow(total, mode):
            log = lambda t: log_overflow(t, "exact" if mode == "exact" else "warn")
            jax.lax.cond(total > 0, lambda: jax.debug.callback(log, total), lambda: None)
        self.overflow_count.set_value(self.overflow_count.get_value() + overflow)
        values = tap(self, values, features)  # a train step's gradient probe
        return self._finish(values, kjt)

    def _forward_local(self, tables, kjt_stacked):
        kjt, pre = input_dist.split(dist.local_kjt(kjt_stacked))
        self._check_ids(kjt)
        out = self._new_output(kjt)
        plans = self._exchanges(kjt, pre)
        rounds, beyond = self._rounds(plans)
        for (g, spec, box), n_rounds in zip(plans, rounds, strict=True):
            out = self._forward_group(tables[g.name], kjt, g, spec, box, n_rounds, out)
        for rg in self.replicated_groups:
            self._dp_lookup(tables[self.dp_buffer(rg)], kjt, rg, out)
        return self._output_value(out), beyond[None]

    def _pooled_lookup(self, group, table, rows, seg, num_segments, scale):
        """The shard's table-batched pooled lookup (quantized collections override it)."""
        del group
        return embedding_bag(table, rows, seg, num_segments, scale)

    def _gather_rows(self, group, table, rows, valid):
        """The shard's row gather for sequence lookups (quantized collections override it)."""
        del group
        return embedding_gather(table, rows, valid)

    def _output_value(self, out):
        return out

    def _check_ids(self, kjt) -> None:
        """Reports out-of-range ids of sharded tables (no shard holds them: they drop)."""
        pairs = [
            (f, t.name, t.num_embeddings)
            for t in self.table_configs
            if t.name not in self.layout.replicated
            for f in t.feature_names
        ]
        check_sharded_ids(kjt, pairs, self.bounds_check_mode)

    def _dp_outputs(self, rg):
        """Output index of each replicated-group slot in the full collection."""
        first = np.cumsum([0] + [t.num_features() for t in self.table_configs]).tolist()
        index = {t.name: i for i, t in enumerate(self.table_configs)}
        return [
            first[index[t]] + j for t in rg.tables for j in range(len(self.config(t).feature_names))
        ]

    # ----- training -----
    def init_optimizer_state(self, optimizer, path: tuple) -> dict:
        """Sparse optimizer states, sharded like the tables they update."""
        out = {}
        for g in self.layout.groups:
            opt = self._group_optimizer(optimizer, set(g.tables))
            st = opt.init(self.layout.world_size * g.rows_per_rank, g.ncols)
            out[state_key(path, g.name, 0)] = self._put_state(st, P(self.axis))
        for rg in self.replicated_groups:
            opt = self._group_optimizer(optimizer, set(rg.tables))
            out[state_key(path, self.dp_buffer(rg), 0)] = self._put_state(
                opt.init(rg.num_rows, rg.embedding_dim), P()
            )
        return out

    def _put_state(self, st, spec):
        return type(st)(
            *(jax.device_put(x, self._sharded(P() if x.ndim == 0 else spec)) for x in st)
        )

    @staticmethod
    def _group_optimizer(optimizer, tables):
        opts = {id(optimizer.for_table(t)): optimizer.for_table(t) for t in tables}
        if len(opts) != 1:
            raise NotImplementedError(
                f"tables {sorted(tables)} share a sharded buffer but not an optimizer; "
                "give them one optimizer or different dims/dtypes"
            )
        return next(iter(opts.values()))

    def _groups_by_name(self) -> dict[str, WidthGroup | TableGroup]:
        """``{buffer name: its WidthGroup, or its TableGroup when replicated}``."""
        out: dict[str, WidthGroup | TableGroup] = {g.name: g for g in self.layout.groups}
        out.update({self.dp_buffer(rg): rg for rg in self.replicated_groups})
        return out

    def apply_sparse_gradients(
        self, optimizer, path, weights, sparse_state, calls, *, dep, implementation=None
    ):
        """Fused optimizer step on the local shards from d loss / d output (one call)."""
        del implementation  # the local updates pick their own (see update_subgroup)
        if len(calls) != 1:
            raise NotImplementedError(
                f"the sharded collection at {path} was called twice in one step"
            )
        features = calls[0].features
        out_grad = jax.tree.map(lambda x: x + 0.0 * dep, calls[0].grad)  # see jaxrec.train
        tables, states = weights, sparse_state
        names = list(self.weights)
        keys = [state_key(path, n, 0) for n in names]
        opts = {
            n: self._group_optimizer(optimizer, set(g.tables))
            for n, g in self._groups_by_name().items()
        }

        def local(tables, states, kjt_stacked, g_local):
            kjt, pre = input_dist.split(dist.local_kjt(kjt_stacked))
            tables, states = dict(tables), dict(states)
            plans = self._exchanges(kjt, pre)
            rounds, _ = self._rounds(plans)  # the forward's, merged with it by XLA's CSE
            for (g, spec, box), n_rounds in zip(plans, rounds, strict=True):
                k = state_key(path, g.name, 0)
                round0, more = self._row_grads(kjt, g, spec, box, g_local)
                tables[g.name], states[k] = exact_update(
                    self._group_update(opts[g.name], g, spec, kjt),
                    tables[g.name],
                    states[k],
                    round0,
                    more if n_rounds is not None else None,
                    n_rounds,
                    fill=g.rows_per_rank,
                    size=_pass_size(g, spec),
                    logical=logical_rows(g, self.axis),
                    axis=self.axis,
                )
            for rg in self.replicated_groups:
                parts = self._dp_row_grads(g_local, kjt, rg)
                r, gr, valid = (jax.lax.all_gather(x, self.axis, tiled=True) for x in parts)
                uniq, summed = dedup_rows(r, gr, valid, rg.num_rows)
                name = self.dp_buffer(rg)
                k = state_key(path, name, 0)
                tables[name], states[k] = update_subgroup(
                    SubGroup(opts[name], (True,), (0,), rg.num_rows),
                    (0,),
                    tables[name],
                    states[k],
                    uniq,
                    summed,
                )
            return tables, states

        specs = self._specs()
        state_specs = {
            k: type(states[k])(
                *(
                    P() if self.buffers[n].replicated or x.ndim == 0 else P(self.axis)
                    for x in states[k]
                )
            )
            for n, k in zip(names, keys, strict=True)
        }
        run = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(specs, state_specs, P(self.axis), P(self.axis)),
            out_specs=(specs, state_specs),
            check_vma=False,
        )
        sub_states = {k: states[k] for k in keys}
        new_tables, new_states = run(tables, sub_states, features, out_grad)
        return new_tables, {**states, **new_states}

    def reset_table_rows(self, table, rows, key) -> None:
        """Re-initialises logical ``rows`` of ``table`` (managed-collision evictions)."""
        sharded_reset.reset_rows(self, table, rows, key)

    def reset_optimizer_rows(self, optimizer, path, group, sparse_state, rows):
        return sharded_reset.reset_optimizer_rows(self, optimizer, path, group, sparse_state, rows)

    def _group_update(self, opt, group, spec, kjt):
        """``(table, state, rows, grads) -> (table, state)``: one width group's row update;
        rows of column-split tables complete their row-wise sums with their peers."""
        caps = dict(zip(kjt.keys(), kjt.capacity_per_key(), strict=True))
        k = _pass_size(group, spec)
        n = self.layout.world_size
        sizes = {
            t.name: min(k, n * sum(caps[f] for f in t.feature_names)) for t in self.table_configs
        }
        try:
            schedule = peer_schedule(group, self.layout, self.table_configs, sizes)
            problem = None
        except NotImplementedError as err:  # only row-wise optimizers need the peers
            schedule, problem = None, err
        reduce = column_split_row_sum(schedule, group.rows_per_rank, self.axis)
        lossy = not self.exact and spec.capacity < natural_load(caps, group.slots)

        def update(table, state, rows, grads):
            if problem is not None:
                row_sum, width = _refuse(problem), None
            elif reduce is not None:
                row_sum, width = reduce(rows)
            else:
                return update_subgroup(
                    SubGroup(opt, (True,), (0,), group.rows_per_rank),
                    (0,),
                    table,
                    state,
                    rows,
                    grads,
                )
            if lossy:
                row_sum = _refuse(
                    NotImplementedError(
                        f"overflow={self.overflow_mode!r} drops ids beyond capacity, which "
                        f"would desynchronise the row-wise state of group {group.name!r}'s "
                        "column shards; use overflow='exact' (the default) or a capacity of "
                        "at least the natural payload"
                    )
                )
            return apply_rows(opt, table, state, rows, grads, dim=width, row_sum=row_sum)

        return update

    # ----- where the tables sit (used by jaxrec.checkpoint) -----
    def table_blocks(self, optimizer, path: tuple) -> TableBlocks:
        """As the interface says. A buffer has one optimizer state (``state_key(path,
        name, 0)``) with its blocks; ``optimizer`` is unused (kept for the signature).

        Logical rows ``[row, row + rows)``, columns ``[col, col + cols)`` of a table
        sit at rows ``[start, start + rows)``, columns ``[0, cols)`` of the global
        buffer (``cols`` below the buffer's width: a zero-padded column shard).
        """
        del optimizer
        weights = {}
        for g in self.layout.groups:
            weights[g.name] = tuple(
                Block(
                    s.table,
                    s.row0,
                    s.nrows,
                    s.col0,
                    g.width(s.table, s.row0, s.col0),
                    rank * g.rows_per_rank + s.local_offset,
                )
                for rank, shards in enumerate(g.shards)
                for s in shards
            )
        for rg in self.replicated_groups:
            weights[self.dp_buffer(rg)] = tuple(
                Block(t, 0, self.config(t).num_embeddings, 0, rg.embedding_dim, lo)
                for t, lo in zip(rg.tables, rg.row_offsets, strict=True)
            )
        states = {state_key(path, name, 0): blocks for name, blocks in weights.items()}
        return TableBlocks(weights, states)


class PooledShardedCollection(ShardedCollection):
    """A sharded collection with one output row per bag: a width group's ids are pooled
    on the shard's rank and the partial sums travel back (``embedding_dist``)."""

    sequence = False

    @abc.abstractmethod
    def _add_group(self, out, kjt, g, received) -> list:
        """Adds a group's returned ``[N, S, B, ncols]`` blocks to ``out``."""

    @abc.abstractmethod
    def _group_grads(self, g, kjt, group) -> jax.Array:
        """A group's ``[N, S, B, ncols]`` output-gradient blocks, per rank and slot."""

    def _forward_group(self, table, kjt, g, spec, box, n_rounds, out) -> list:
        rec0, bag_counts = self._first_round(spec, box)
        lookup = lambda rec: dist.pooled_partials(
            lambda *a: self._pooled_lookup(g, *a), table, rec, spec
        )
        partials = lookup(rec0)
        if n_rounds is not None:
            partials = jax.lax.fori_loop(
                1,
                n_rounds,
                lambda r, acc: acc + lookup(self._round(spec, box, bag_counts, r)),
                partials,
            )
        sizes = dist.slot_counts(g, self.axis) if spec.ragged else None  # no pad slots
        received = dist.send_back(partials, self.axis, self.qcomms.forward_dtype, ragged=sizes)
        return self._add_group(list(out), kjt, g, received)

    def _row_grads(self, kjt, g, spec, box, g_local) -> tuple[tuple, Callable]:
        rec0, bag_counts = self._first_round(spec, box)
        dtype = self.qcomms.backward_dtype
        scale = self.qcomms.backward_loss_scale
        blocks = self._group_grads(g_local, kjt, g)
        blocks = dist.grads_to_ranks(blocks, g, self.axis, dtype, scale, spec.ragged)
        grads = lambda rec: dist.pooled_row_grads(blocks, rec, spec)

        def more(r):
            rows, g, valid = grads(self._round(spec, box, bag_counts, r))
            return rows, valid, lambda: g

        return grads(rec0), more


class SequenceShardedCollection(ShardedCollection):
    """A sharded collection with one output row per id: each id's row (slice) travels
    back from its shard and is placed in the output (``embedding_dist``)."""

    sequence = True

    @abc.abstractmethod
    def _add_block(self, out, kjt, slot, ncols, block) -> None:
        """Adds ``slot``'s returned rows ``block`` ``[C, ncols]`` to ``out``, in place."""

    def _forward_group(self, table, kjt, g, spec, box, n_rounds, out) -> list:
        rec0, _ = self._first_round(spec, box)
        dtype = self.qcomms.forward_dtype

        def place(r, rec, acc):
            rows = dist.sequence_rows(lambda *a: self._gather_rows(g, *a), table, rec)
            back = dist.send_back(rows, self.axis, dtype)
            acc = list(acc)
            add = lambda sl, blk: self._add_block(acc, kjt, sl, sl.ncols, blk)
            dist.place_rows(back, box, g, r, spec.capacity, add)
            return tuple(acc)

        res = place(0, rec0, tuple(out))
        if n_rounds is not None:
            res = jax.lax.fori_loop(
                1, n_rounds, lambda r, acc: place(r, self._round(spec, box, None, r), acc), res
            )
        return list(res)

    def _row_grads(self, kjt, g, spec, box, g_local) -> tuple[tuple, Callable]:
        rec0, _ = self._first_round(spec, box)
        dtype = self.qcomms.backward_dtype
        read = lambda sl: self._read_block(g_local, kjt, sl, sl.ncols, None)

        def grads(r):
            got = dist.sequence_grads(
                read, box, g, r, spec.capacity, self.axis, dtype, self.qcomms.backward_loss_scale
            )
            return got.reshape(-1, g.ncols)

        def more(r):
            rec = self._round(spec, box, None, r)
            return rec.rows.reshape(-1), rec.valid.reshape(-1), lambda: grads(r)

        return (rec0.rows.reshape(-1), grads(0), rec0.valid.reshape(-1)), more


def _vbe_bags(kjt, group: WidthGroup) -> int:
    """A VBE batch's ``(slot, bag)`` rows per source: the most any rank's slots hold."""
    spk, keys = kjt.stride_per_key(), kjt.keys()
    return max(1, max(sum(spk[keys.index(sl.key)] for sl in slots) for slots in group.slots))


def _pass_size(group: WidthGroup, spec: exchange.Spec) -> int:
    """Distinct rows one overflow pass holds: a round's ids, and more than a rank's shards
    (so every pass makes progress; see ``exact_update``)."""
    return max(spec.n * spec.capacity, max(len(r) for r in group.shards) + 1)


def _refuse(error: Exception):
    """A ``row_sum`` that raises ``error`` if an optimizer asks for a row-wise sum."""

    def row_sum(partial):
        raise error

    return row_sum


def _stack_checks(reports) -> tuple:
    """``(counts [1, k] int32, {example dtype name: examples [1, k_dtype]})`` in check order."""
    zero = [jnp.zeros((), jnp.int32)]
    counts = jnp.stack([jnp.asarray(r.count, jnp.int32) for r in reports] or zero)
    by_dtype: dict = {}
    for r in reports:
        by_dtype.setdefault(jnp.dtype(r.example.dtype).name, []).append(r.example)
    return counts[None], {dt: jnp.stack(ex)[None] for dt, ex in by_dtype.items()}


def _lowest(dtype):
    dtype = jnp.dtype(dtype)
    return jnp.iinfo(dtype).min if jnp.issubdtype(dtype, jnp.integer) else -jnp.inf
