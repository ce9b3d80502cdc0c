"""ShardedEmbeddingBagCollection: an EmbeddingBagCollection split over a device mesh."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, Unpack

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..ops import grouped_pooled_lookup
from ..sparse import KeyedTensor
from ..xla.backward import pooled_row_grads
from ..xla.slots import slot_bag_starts
from .embedding_dist import column_offsets
from .sharded_base import OverflowCount as OverflowCount
from .sharded_base import PooledShardedCollection, ShardOptions, ShardSource
from .types import ParameterSharding


class PooledSource(ShardSource, Protocol):
    """What :class:`ShardedEmbeddingBagCollection` reads of the module it shards (an
    ``EmbeddingBagCollection`` or a quantized one)."""

    def is_weighted(self) -> bool: ...
    @property
    def length_per_embedding(self) -> tuple[int, ...]: ...


class ShardedEmbeddingBagCollection(PooledShardedCollection):
    """An ``EmbeddingBagCollection`` sharded per a plan over ``mesh`` (all its axes).

    Input: a batch-sharded KJT from :func:`jaxrec.distributed.shard_batch` (one
    local KJT per device, stacked). Output: a ``KeyedTensor`` whose values are
    ``[world * B, sum(D)]`` sharded over the batch, equal to the unsharded
    module's output on the concatenated batch. Tables live as
    ``[world * rows_per_rank, ncols]`` arrays per width group (padded rows are
    never read); ``state_dict()`` returns logical ``[num_embeddings, dim]``
    tables (gathered to one host array each, from every process if needed).

    Args:
        ebc: the unsharded module (its weights are copied).
        plan: ``{table: ParameterSharding}`` (an ``EmbeddingModuleShardingPlan``).
        mesh: a ``jax.sharding.Mesh`` (Auto axis types); ranks are its flat device order.
        capacity: the exchange's fast path: ids per (source, destination) pair per
            width group and round. ``None`` (default): sized from the expected
            load (``pooling_factors``; see :mod:`jaxrec.distributed.capacity`);
            an int for every group, or ``{group name: int}`` (names as in
            :meth:`capacities`, e.g. ``"fp32_c64"``).
        overflow: what happens to ids beyond the fast path. ``"exact"`` (default):
            they take extra exchange rounds, so results are exact and only that
            step is slower; they are counted in ``overflow_count`` (per device).
            The drop modes (explicit opt-in) drop them and count them:
            ``"raise"``: the train step raises
            :class:`jaxrec.train.CapacityOverflowError` after the step that
            dropped them (outside a train step it logs, as ``"warn"``); ``"warn"``
            logs a warning on the ``jaxrec`` logger; ``"count"`` only counts.
            (In the drop modes, groups holding column shards use their natural
            payload: their row-wise state needs every id on every shard.)
        pooling_factors: ``{feature: mean ids per bag}`` (TorchRec's planner
            statistic): the expected load is ``B * pooling factor`` per
            feature and device, spread over a table's rows; a feature without
            one counts its whole capacity.
        capacity_factor: headroom of the statistics-sized capacity (default 1.1,
            plus three standard deviations of a Poisson load).
        qcomms: :class:`QCommsConfig` precisions of the pooled blocks forward
            and their gradients backward (TorchRec's QComms); default float32.
        exchange: ``"padded"`` (default): id payloads and pooled blocks travel
            whole in ``all_to_all`` s; ``"ragged"``: ``jax.lax.ragged_all_to_all``
            moves only the ids there are and each rank's own slots' blocks, not
            the padding up to the fullest rank (GPUs; XLA:CPU lacks the op).
            Compiled for H100s in CI; its results are not yet checked on a GPU.
    """

    vbe = True  # a variable batch per key: looked up per key's bags, expanded in _finish

    def __init__(
        self,
        ebc: PooledSource,
        plan: Mapping[str, ParameterSharding],
        mesh: jax.sharding.Mesh,
        **options: Unpack[ShardOptions],
    ):
        self._is_weighted = ebc.is_weighted()
        self.length_per_embedding = ebc.length_per_embedding
        super().__init__(ebc, plan, mesh, **options)

    def embedding_bag_configs(self):
        return list(self.table_configs)

    def is_weighted(self) -> bool:
        return self._is_weighted

    # ----- hooks: one pooled [B, sum(D)] output per device -----
    def _weighted(self) -> bool:
        return self._is_weighted

    def _new_output(self, kjt):
        if kjt.variable_stride_per_key():  # packed per output: [B_k, D] each, flattened
            return [jnp.zeros((int(self._vbe_packing(kjt)[1][-1]),), jnp.float32)]
        return [jnp.zeros((kjt.stride(), sum(self.layout.dims)), jnp.float32)]

    def _output_value(self, out):
        return out[0]

    def _read_block(self, g, kjt, slot, ncols, b):
        """One slot's output gradient (the position-weight gradient of a sharded
        feature-processed collection reads it slot by slot)."""
        c = column_offsets(self.layout)[slot.output] + slot.col0
        return g[:, c : c + ncols].astype(jnp.float32) * _mean(kjt, slot)

    # One scatter / gather per width group over static column indices, not one
    # slice per slot: trace and compile cost follow groups, not tables.
    def _add_group(self, out, kjt, g, received):
        if kjt.variable_stride_per_key():  # received [N, sum_j B_j, ncols]
            idx, factors = self._vbe_targets(kjt, g)
            values = received * factors[:, :, None]
            return [out[0].at[idx.reshape(-1)].add(values.reshape(-1), mode="drop")]
        n, s, b, w = received.shape
        cols, factors = self._slot_columns(kjt, g)
        blocks = received.reshape(n * s, b, w) * factors[:, :, None]
        values = blocks.transpose(1, 0, 2).reshape(b, n * s * w)
        return [out[0].at[:, cols].add(values, mode="drop")]

    def _group_grads(self, g, kjt, group):
        if kjt.variable_stride_per_key():  # g: the packed [P] output gradient
            idx, factors = self._vbe_targets(kjt, group)
            padded = jnp.concatenate([g.astype(jnp.float32), jnp.zeros((1,), jnp.float32)])
            return jnp.take(padded, idx, axis=0) * factors[:, :, None]
        cols, factors = self._slot_columns(kjt, group)
        n, s, b, w = len(group.slots), group.max_slots, kjt.stride(), group.ncols
        # Column ``total`` is a zero column: padding slots and a narrow slot's padding.
        g = jnp.concatenate([g.astype(jnp.float32), jnp.zeros((b, 1), jnp.float32)], axis=1)
        got = jnp.take(g, cols, axis=1)
        blocks = got.reshape(b, n * s, w).transpose(1, 0, 2) * factors[:, :, None]
        return blocks.reshape(n, s, b, w)

    def _slot_columns(self, kjt, g):
        """Static output column of every ``(rank, slot, col)`` of group ``g`` (one past the
        last column for padding slots and a zero-padded slot's padding columns), and
        ``[N * S, B]`` factors: MEAN slots' ``1 / length``, 1 for SUM, 0 for padding."""
        offsets = column_offsets(self.layout)
        n, s, w, total = len(g.slots), g.max_slots, g.ncols, int(offsets[-1])
        start = np.full((n, s), total, np.int64)
        width = np.zeros((n, s), np.int64)  # a slot's own columns (padding: 0)
        key = np.zeros((n, s), np.int32)
        kind = np.zeros((n, s), np.int32)  # 0 padding, 1 SUM, 2 MEAN
        keys = {k: i for i, k in enumerate(kjt.keys())}
        for p, slots in enumerate(g.slots):
            for j, sl in enumerate(slots):
                start[p, j], width[p, j] = offsets[sl.output] + sl.col0, sl.ncols
                key[p, j], kind[p, j] = keys[sl.key], 2 if sl.mean else 1
        col = np.arange(w)
        cols = np.where(col < width[:, :, None], start[:, :, None] + col, total)
        inv = _inverse_lengths(kjt)  # [F, B]
        per_kind = jnp.stack([jnp.zeros_like(inv), jnp.ones_like(inv), inv])  # [3, F, B]
        factors = per_kind[kind.reshape(-1), key.reshape(-1)]
        return cols.reshape(-1), factors

    def _dp_lookup(self, table, kjt, rg, out):
        pooled = grouped_pooled_lookup(
            table,
            kjt,
            rg.slots,
            is_weighted=self._is_weighted,
            bounds_check_mode=self.bounds_check_mode,
            implementation=self.implementation,
        )
        if kjt.variable_stride_per_key():  # [sum_j B_j, D] into the packed output
            out[0] = out[0].at[self._vbe_dp_positions(kjt, rg)].set(pooled.reshape(-1))
            return
        cols = self._dp_columns(rg)
        out[0] = out[0].at[:, cols].set(pooled.reshape(pooled.shape[0], len(cols)))

    def _dp_row_grads(self, g, kjt, rg):
        if kjt.variable_stride_per_key():
            gg = jnp.take(g, self._vbe_dp_positions(kjt, rg)).reshape(-1, rg.embedding_dim)
            return pooled_row_grads(gg, kjt, rg.slots, is_weighted=self._is_weighted)
        cols = self._dp_columns(rg)
        gg = jnp.take(g, cols, axis=1).reshape(g.shape[0], len(rg.slots), rg.embedding_dim)
        return pooled_row_grads(gg, kjt, rg.slots, is_weighted=self._is_weighted)

    def _dp_columns(self, rg) -> np.ndarray:
        """Static output columns of a replicated group's slots, slot-major."""
        offsets = column_offsets(self.layout)
        starts = np.asarray([offsets[o] for o in self._dp_outputs(rg)], np.int64)
        return (starts[:, None] + np.arange(rg.embedding_dim)).reshape(-1)

    # ----- a variable batch per key (VBE): one packed output per device -----
    def _vbe_packing(self, kjt) -> tuple[list[int], np.ndarray]:
        """``(key index of each output, [O + 1] start of each output in the packed
        output)``: output ``o`` holds its key's ``B_k`` bags, ``[B_k, D_o]`` row-major."""
        keys, spk = kjt.keys(), kjt.stride_per_key()
        key_of = [keys.index(f) for t in self.table_configs for f in t.feature_names]
        sizes = [spk[k] * d for k, d in zip(key_of, self.layout.dims, strict=True)]
        return key_of, np.cumsum([0, *sizes])

    def _vbe_targets(self, kjt, g) -> tuple[np.ndarray, jax.Array]:
        """Static packed position of every ``(rank, slot bag, col)`` of group ``g``'s
        blocks ``[N, sum_j B_j, ncols]`` (the packed size for padding), and ``[N, sum_j
        B_j]`` factors: MEAN bags' ``1 / length``, 1 for SUM, 0 for padding."""
        _, po = self._vbe_packing(kjt)
        keys, spk, bag0 = kjt.keys(), kjt.stride_per_key(), kjt.bag_offsets()
        n, w = len(g.slots), g.ncols
        sb = max(1, max(sum(spk[keys.index(sl.key)] for sl in slots) for slots in g.slots))
        idx = np.full((n, sb, w), po[-1], np.int64)
        length_at = np.zeros((n, sb), np.int32)  # the bag's index in lengths()
        kind = np.zeros((n, sb), np.int32)  # 0 padding, 1 SUM, 2 MEAN
        for p, slots in enumerate(g.slots):
            starts = slot_bag_starts(kjt, slots)
            for j, sl in enumerate(slots):
                k, d = keys.index(sl.key), self.layout.dims[sl.output]
                bags, cols = np.arange(spk[k]), np.arange(sl.ncols)
                q = starts[j] + bags
                idx[p, q[:, None], cols] = po[sl.output] + bags[:, None] * d + sl.col0 + cols
                length_at[p, q], kind[p, q] = bag0[k] + bags, 2 if sl.mean else 1
        lengths = jnp.take(kjt.lengths(), length_at) if kjt.lengths().size else length_at
        inv = 1.0 / jnp.maximum(lengths, 1).astype(jnp.float32)
        factors = jnp.where(kind == 2, inv, (kind == 1).astype(jnp.float32))
        return idx, factors

    def _vbe_dp_positions(self, kjt, rg) -> np.ndarray:
        """Static packed positions of a replicated group's ``[sum_j B_j, D]`` lookup."""
        _, po = self._vbe_packing(kjt)
        keys, spk, d = kjt.keys(), kjt.stride_per_key(), rg.embedding_dim
        out = [
            po[o] + np.arange(spk[keys.index(sl.key)] * d)
            for sl, o in zip(rg.slots, self._dp_outputs(rg), strict=True)
        ]
        return np.concatenate(out).astype(np.int64)

    def _vbe_expand(self, packed, features):
        """``[world * B, sum(D)]``: each device's packed output expanded to its samples
        with its own inverse indices (the gradient: a segment sum per bag)."""
        key_of, po = self._vbe_packing(features)
        dims = self.layout.dims
        base = np.concatenate([po[o] + np.arange(d) for o, d in enumerate(dims)])
        mult = np.repeat(np.asarray(dims, np.int64), dims)
        key = np.repeat(np.asarray(key_of, np.int32), dims)

        def local(packed, inverse):  # [P], [1, F, B]
            rows = jnp.take(inverse[0], key, axis=0).T  # [B, sum(D)]
            return jnp.take(packed, base + rows * mult, axis=0)

        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(P(self.axis), P(self.axis)),
            out_specs=P(self.axis),
            check_vma=False,
        )(packed, features.inverse_indices()[1])

    def _finish(self, values, features):
        if features.variable_stride_per_key():
            values = self._vbe_expand(values, features)
        return KeyedTensor(
            self.embedding_names, self.length_per_embedding, values.astype(self.dtype)
        )


def _inverse_lengths(kjt) -> jax.Array:
    """``[F, B]`` ``1 / max(length, 1)`` of every bag (the MEAN factors)."""
    f, b = len(kjt.keys()), kjt.stride()
    return 1.0 / jnp.maximum(kjt.lengths().reshape(f, b), 1).astype(jnp.float32)


def _mean(kjt, slot):
    """``[B, 1]`` factors of a MEAN slot (``1 / max(length, 1)``), 1.0 for SUM: applied
    where the samples live, so a row shard never needs a bag's whole length."""
    if not slot.mean:
        return 1.0
    k, b = kjt.keys().index(slot.key), kjt.stride()
    lengths = kjt.lengths()[k * b : (k + 1) * b]
    return (1.0 / jnp.maximum(lengths, 1).astype(jnp.float32))[:, None]
