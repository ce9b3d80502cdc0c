"""ShardedEmbeddingBagCollection: an EmbeddingBagCollection split over a device mesh."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..modules.embedding_bag_collection import EmbeddingBagCollection
from ..modules.tables import EmbeddingTable, group_tables
from ..ops import check_ids, grouped_pooled_lookup
from ..ops.backward import dedup_rows, pooled_row_grads
from ..ops.bounds import logger
from ..optim.combined import SubGroup, state_key
from ..sparse import KeyedJaggedTensor, KeyedTensor
from ..train.sparse_update import update_subgroup
from ..train.tape import tap
from . import embedding_dist as dist
from .layout import build_layout
from .types import ParameterSharding


class OverflowCount(nnx.Variable):
    """Row-wise ids dropped for lack of capacity, per device, since construction."""


class ShardedEmbeddingBagCollection(nnx.Module):
    """An ``EmbeddingBagCollection`` sharded per a plan over ``mesh`` (all its axes).

    Input: a batch-sharded KJT from :func:`jaxrec.distributed.shard_batch` (one
    local KJT per device, stacked). Output: a ``KeyedTensor`` whose values are
    ``[world * B, sum(D)]`` sharded over the batch, equal to the unsharded
    module's output on the concatenated batch. Tables live as
    ``[world * rows_per_rank, ncols]`` arrays per width group (padded rows are
    never read); ``state_dict()`` returns logical ``[num_embeddings, dim]``
    tables (gathered to one host array each).

    Args:
        ebc: the unsharded module (its weights are copied).
        plan: ``{table: ParameterSharding}`` (an ``EmbeddingModuleShardingPlan``).
        mesh: a ``jax.sharding.Mesh`` (Auto axis types); ranks are its flat device order.
        capacity: ids per destination rank per width group for row-sliced shards;
            ``None`` means the features' whole capacity (never overflows).
        overflow: ids that do not fit the capacity are dropped and added to
            ``overflow_count`` (per device); ``"warn"`` (default) also logs a
            warning on the ``jaxrec`` logger, ``"count"`` only counts. (A
            failing host callback aborts multi-device XLA:CPU programs, so
            there is no raising mode: check ``overflow_count``.)
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        plan: Mapping[str, ParameterSharding],
        mesh: jax.sharding.Mesh,
        *,
        capacity: int | None = None,
        overflow: str = "warn",
    ):
        if overflow not in ("warn", "count"):
            raise ValueError(f"overflow must be 'warn' or 'count', got {overflow!r}")
        self.table_configs = ebc.table_configs
        self.prefix = ebc.prefix
        self.layout = build_layout(self.table_configs, plan, mesh.size)
        self.plan = dict(plan)
        self.mesh = mesh
        self.axis = tuple(mesh.axis_names)
        self._is_weighted = ebc.is_weighted()
        self.bounds_check_mode = ebc.bounds_check_mode
        self.implementation = ebc.implementation
        self.dtype = ebc.dtype
        self.embedding_names = ebc.embedding_names
        self.length_per_embedding = ebc.length_per_embedding
        self.capacity = capacity
        self.overflow_mode = overflow
        dp = [t for t in self.table_configs if t.name in self.layout.replicated]
        self.replicated_groups = group_tables(dp) if dp else ()
        self._dp_first = {t.name: i for i, t in enumerate(self.table_configs)}
        self.weights = nnx.Dict(self._place(ebc.state_dict()))
        self.overflow_count = OverflowCount(jnp.zeros((mesh.size,), jnp.int32))

    # ----- placement and logical views -----
    def _sharded(self, spec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def _config(self, name):
        return next(t for t in self.table_configs if t.name == name)

    def _place(self, state_dict: Mapping[str, Any]) -> dict:
        logical = {
            t.name: np.asarray(state_dict[f"{self.prefix}.{t.name}.weight"])
            for t in self.table_configs
        }
        out = {}
        n = self.layout.world_size
        for g in self.layout.groups:
            dtype = self._config(g.shards[next(i for i, s in enumerate(g.shards) if s)][0][0]).dtype
            buf = np.zeros((n * g.rows_per_rank, g.ncols), np.float32)
            for rank, shards in enumerate(g.shards):
                for table, r0, nr, c0, off in shards:
                    start = rank * g.rows_per_rank + off
                    buf[start : start + nr] = logical[table][r0 : r0 + nr, c0 : c0 + g.ncols]
            out[g.name] = EmbeddingTable(
                jax.device_put(jnp.asarray(buf, dtype), self._sharded(P(self.axis)))
            )
        for rg in self.replicated_groups:
            buf = np.concatenate([logical[t] for t in rg.tables])
            dtype = self._config(rg.tables[0]).dtype
            out["dp_" + rg.name] = EmbeddingTable(
                jax.device_put(jnp.asarray(buf, dtype), self._sharded(P()))
            )
        return out

    def state_dict(self) -> dict[str, jax.Array]:
        """Logical ``{"embedding_bags.<table>.weight": [num_embeddings, dim]}`` tables."""
        logical = {
            t.name: np.zeros((t.num_embeddings, t.embedding_dim), np.float32)
            for t in self.table_configs
        }
        for g in self.layout.groups:
            buf = np.asarray(self.weights[g.name].get_value().astype(jnp.float32))
            for rank, shards in enumerate(g.shards):
                for table, r0, nr, c0, off in shards:
                    start = rank * g.rows_per_rank + off
                    logical[table][r0 : r0 + nr, c0 : c0 + g.ncols] = buf[start : start + nr]
        for rg in self.replicated_groups:
            buf = np.asarray(self.weights["dp_" + rg.name].get_value().astype(jnp.float32))
            for t, lo in zip(rg.tables, rg.row_offsets, strict=True):
                logical[t] = buf[lo : lo + self._config(t).num_embeddings]
        return {
            f"{self.prefix}.{t.name}.weight": jnp.asarray(logical[t.name], t.dtype)
            for t in self.table_configs
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        expected = {f"{self.prefix}.{t.name}.weight" for t in self.table_configs}
        if set(state_dict) != expected:
            raise ValueError(
                f"load_state_dict: expected exactly {sorted(expected)}, got {sorted(state_dict)}"
            )
        for name, var in self._place(state_dict).items():
            self.weights[name].set_value(var.get_value())

    def embedding_bag_configs(self):
        return list(self.table_configs)

    def is_weighted(self) -> bool:
        return self._is_weighted

    # ----- forward -----
    def _specs(self):
        return {name: P() if name.startswith("dp_") else P(self.axis) for name in self.weights}

    def _capacity(self, kjt, group) -> int:
        natural = dist.natural_capacity(kjt, group)
        return natural if self.capacity is None else min(self.capacity, natural)

    def __call__(self, features: KeyedJaggedTensor) -> KeyedTensor:
        tables = {name: v.get_value() for name, v in self.weights.items()}
        fwd = jax.shard_map(
            self._forward_local,
            mesh=self.mesh,
            in_specs=(self._specs(), P(self.axis)),
            out_specs=(P(self.axis), P(self.axis)),
            check_vma=False,
        )
        values, overflow = fwd(tables, features)
        if self.overflow_mode == "warn":  # one host callback, only when ids were dropped
            total = jnp.sum(overflow)
            jax.lax.cond(total > 0, lambda: jax.debug.callback(_warn_overflow, total), lambda: None)
        self.overflow_count.set_value(self.overflow_count.get_value() + overflow)
        values = tap(self, values, features)  # a train step's gradient probe
        return KeyedTensor(
            self.embedding_names, self.length_per_embedding, values.astype(self.dtype)
        )

    def _forward_local(self, tables, kjt_stacked):
        kjt = dist.local_kjt(kjt_stacked)
        b = kjt.stride()
        self._check_ids(kjt)
        out = jnp.zeros((b, sum(self.layout.dims)), jnp.float32)
        overflow = jnp.zeros((), jnp.int32)
        for g in self.layout.groups:
            rows, seg, scale, ov = dist.input_dist(
                kjt, g, self.axis, self._capacity(kjt, g), self._is_weighted
            )
            partials = dist.local_lookup(tables[g.name], rows, seg, scale, g.max_slots, b)
            out = dist.assemble(dist.output_dist(partials, self.axis), g, self.layout, out)
            overflow += ov
        cols = dist.column_offsets(self.layout)
        for rg in self.replicated_groups:
            pooled = grouped_pooled_lookup(
                tables["dp_" + rg.name], kjt, self._dp_slots(rg), is_weighted=self._is_weighted,
                bounds_check_mode=self.bounds_check_mode, implementation=self.implementation,
            )  # fmt: skip
            for j, o in enumerate(self._dp_outputs(rg)):
                out = out.at[:, cols[o] : cols[o + 1]].set(pooled[:, j])
        return out, overflow[None]

    def _dp_slots(self, rg):
        return rg.slots

    def _dp_outputs(self, rg):
        """Output index of each replicated-group slot in the full collection."""
        first = np.cumsum([0] + [t.num_features() for t in self.table_configs]).tolist()
        out = []
        for t in rg.tables:
            i = self._dp_first[t]
            out += [first[i] + j for j in range(self.table_configs[i].num_features())]
        return out

    def _check_ids(self, kjt) -> None:
        """Reports out-of-range ids of sharded tables (no shard holds them: they drop)."""
        for t in self.table_configs:
            if t.name in self.layout.replicated:
                continue
            for f in t.feature_names:
                jt = kjt[f]
                check_ids(jt.values(), jt.valid_mask(), t.num_embeddings, self.bounds_check_mode,
                          f"sharded lookup of {f!r} in table {t.name!r}")  # fmt: skip

    # ----- training -----
    def init_optimizer_state(self, optimizer, path: tuple) -> dict:
        """Sparse optimizer states, sharded like the tables they update."""
        out = {}
        for g in self.layout.groups:
            opt = self._group_optimizer(optimizer, {s[0] for r in g.shards for s in r})
            st = opt.init(self.layout.world_size * g.rows_per_rank, g.ncols)
            out[state_key(path, g.name, 0)] = self._put_state(st, P(self.axis))
        for rg in self.replicated_groups:
            opt = self._group_optimizer(optimizer, set(rg.tables))
            out[state_key(path, "dp_" + rg.name, 0)] = self._put_state(
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

    def sparse_update(self, optimizer, path, tables, states, features, out_grad):
        """Fused optimizer step on the local shards from d loss / d output ``[world*B, D]``."""
        names = list(self.weights)
        keys = [state_key(path, n, 0) for n in names]
        opts = {
            n: self._group_optimizer(
                optimizer,
                {s[0] for r in g.shards for s in r} if not n.startswith("dp_") else set(g.tables),
            )
            for n, g in self._groups_by_name().items()
        }

        def local(tables, states, kjt_stacked, g_local):
            kjt = dist.local_kjt(kjt_stacked)
            b = kjt.stride()
            tables, states = dict(tables), dict(states)
            for g in self.layout.groups:
                rows, seg, scale, _ = dist.input_dist(
                    kjt, g, self.axis, self._capacity(kjt, g), self._is_weighted
                )
                recv = dist.grads_to_ranks(g_local, g, self.layout, self.axis)
                r, gr, valid = dist.row_grads(recv, rows, seg, scale, g.max_slots, b)
                uniq, summed = dedup_rows(r, gr, valid, g.rows_per_rank)
                k = state_key(path, g.name, 0)
                tables[g.name], states[k] = update_subgroup(
                    SubGroup(opts[g.name], (True,), (0,), g.rows_per_rank), (0,),
                    tables[g.name], states[k], uniq, summed,
                )  # fmt: skip
            cols = dist.column_offsets(self.layout)
            for rg in self.replicated_groups:
                outs = self._dp_outputs(rg)
                gg = jnp.stack([g_local[:, cols[o] : cols[o + 1]] for o in outs], axis=1)
                parts = pooled_row_grads(gg, kjt, rg.slots, is_weighted=self._is_weighted)
                r, gr, valid = (jax.lax.all_gather(x, self.axis, tiled=True) for x in parts)
                uniq, summed = dedup_rows(r, gr, valid, rg.num_rows)
                name, k = "dp_" + rg.name, state_key(path, "dp_" + rg.name, 0)
                tables[name], states[k] = update_subgroup(
                    SubGroup(opts[name], (True,), (0,), rg.num_rows), (0,),
                    tables[name], states[k], uniq, summed,
                )  # fmt: skip
            return tables, states

        specs = self._specs()
        state_specs = {
            k: type(states[k])(*(P() if n.startswith("dp_") or x.ndim == 0 else P(self.axis)
                                 for x in states[k]))
            for n, k in zip(names, keys, strict=True)
        }  # fmt: skip
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

    def _groups_by_name(self):
        out = {g.name: g for g in self.layout.groups}
        out.update({"dp_" + rg.name: rg for rg in self.replicated_groups})
        return out


def _warn_overflow(overflow) -> None:
    if int(overflow):
        logger.warning(
            "row-wise input_dist dropped %d ids that did not fit the per-destination "
            "capacity (counted in overflow_count); raise capacity=",
            int(overflow),
        )
