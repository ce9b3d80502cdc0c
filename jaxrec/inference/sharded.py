"""Sharded quantized inference: quantized collections split over a device mesh.

The sharded float collections' engine (``jaxrec.distributed``: layout,
``input_dist -> lookup -> output_dist`` under ``shard_map``) with uint8 TBE
rows as the local buffers and the dequantizing lookup as the local stage.
Every shard holds whole quantized rows of its block:

- table-wise / row-wise shards hold full-width rows: the unsharded module's
  bytes are copied as they are, so outputs equal the unsharded quantized
  module's;
- column-wise (and table-column-wise / grid) shards hold a column slice,
  which needs its own scale and bias: each slice is quantized separately, as
  FBGEMM does. From a float module that is one rounding (the slice's own
  min/max, at least as accurate as the whole row's); from an already quantized
  module the slice is dequantized and requantized (two roundings: the error
  bound is the sum of both).

Importing this module registers the quantized collections with
``jaxrec.distributed.DistributedModelParallel`` (so a model from
``quantize_inference_model`` shards with it directly); :func:`shard_quant_model`
also quantizes float collections per shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Unpack

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from ..configs import DataType
from ..distributed import embedding_dist as dist
from ..distributed.model_parallel import SHARDERS
from ..distributed.sharded_base import HostOrDevice, ShardedCollection, ShardOptions
from ..distributed.sharded_ebc import ShardedEmbeddingBagCollection
from ..distributed.sharded_ec import ShardedEmbeddingCollection
from ..distributed.types import ParameterSharding, ShardingPlan
from ..embedding.collection import replace_collection
from ..modules.embedding_bag_collection import EmbeddingBagCollection
from ..modules.embedding_collection import EmbeddingCollection
from ..xla.quantize import DEFAULT_ROW_ALIGNMENT, dequantize_table, row_bytes
from .quant_modules import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    QuantTable,
    quantize_jit,
    table_dtypes,
)
from .quant_ops import (
    quant_embedding_bag,
    quant_grouped_pooled_lookup,
    quant_grouped_sequence_lookup,
)

_QUANT = (QuantEmbeddingBagCollection, QuantEmbeddingCollection)
# A quantized row dtype: "int8" | "int4" | "fp16" | "bf16" | "fp32", a DataType or a JAX dtype.
QuantDType = DataType | DTypeLike


# The mixin reads the sharded collection's attributes (layout, prefix, weights ...):
# the type checker sees it as one; at run time it is a plain mixin.
if TYPE_CHECKING:
    _MixedInto = ShardedCollection
else:
    _MixedInto = object


class _QuantShards(_MixedInto):
    """Placement and forward of quantized shards (mixed into the sharded collections)."""

    def _setup_quant(self, module, dtype, per_table_dtype, row_alignment) -> None:
        if isinstance(module, _QUANT):
            if dtype is not None or per_table_dtype:
                raise ValueError("module is already quantized; do not pass dtype/per_table_dtype")
            self.data_types = dict(module.data_types)
            self.row_alignment = module.row_alignment
            self._source_quantized = True
        else:
            self.data_types = table_dtypes(module.table_configs, dtype or "int8", per_table_dtype)
            self.row_alignment = row_alignment
            self._source_quantized = False

    def _one_dtype(self, tables, what) -> str:
        dts = {self.data_types[t] for t in tables}
        if len(dts) != 1:
            raise NotImplementedError(
                f"{what} stacks tables {sorted(tables)} with different quantized dtypes "
                f"{sorted(dts)}; give tables of one shard width (or one dim, for data-parallel "
                "tables) one dtype"
            )
        return dts.pop()

    def _block(self, src, table, r0, nr, c0, nc, dt, pad_to=None) -> np.ndarray:
        dim = self.config(table).embedding_dim
        if self._source_quantized:
            rows = np.asarray(src[r0 : r0 + nr])
            if c0 == 0 and nc == dim:
                return rows  # whole rows: the unsharded module's bytes
            src = dequantize_table(rows, dim, dt)
            r0 = 0
        block = np.asarray(src[r0 : r0 + nr, c0 : c0 + nc], np.float32)
        if pad_to is not None and pad_to > nc:  # a zero-padded column shard (layout.py):
            # repeat the last column, so each row's range (its scale and bias) is unchanged;
            # the padding columns are never read into an output
            block = np.pad(block, [(0, 0), (0, pad_to - nc)], mode="edge")
        return np.asarray(quantize_jit(block, dtype=dt, row_alignment=self.row_alignment))

    def _place(self, state_dict: Mapping[str, HostOrDevice]) -> dict:
        n = self.layout.world_size
        self.group_dtypes = {}
        out = {}
        for g in self.layout.groups:
            dt = self._one_dtype(set(g.tables), f"shard group {g.name}")
            self.group_dtypes[g.name] = dt
            buf = np.zeros((n * g.rows_per_rank, row_bytes(g.ncols, dt, self.row_alignment)))
            buf = buf.astype(np.uint8)
            for rank, shards in enumerate(g.shards):
                for s in shards:
                    src = state_dict[f"{self.prefix}.{s.table}.weight"]
                    start = rank * g.rows_per_rank + s.local_offset
                    w = g.width(s.table, s.row0, s.col0)
                    block = self._block(src, s.table, s.row0, s.nrows, s.col0, w, dt, g.ncols)
                    buf[start : start + s.nrows] = block
            out[g.name] = QuantTable(jax.device_put(buf, self._sharded(P(self.axis))))
        for rg in self.replicated_groups:
            dt = self._one_dtype(rg.tables, "data-parallel group " + rg.name)
            self.group_dtypes[self.dp_buffer(rg)] = dt
            pieces = []
            for t in rg.tables:
                cfg = self.config(t)
                src = state_dict[f"{self.prefix}.{t}.weight"]
                pieces.append(self._block(src, t, 0, cfg.num_embeddings, 0, cfg.embedding_dim, dt))
            out[self.dp_buffer(rg)] = QuantTable(
                jax.device_put(np.concatenate(pieces), self._sharded(P()))
            )
        return out

    def _pooled_lookup(self, group, table, rows, seg, num_segments, scale):
        """The dequantizing pooled lookup of a shard's uint8 rows."""
        return quant_embedding_bag(
            table,
            rows,
            seg,
            num_segments,
            scale,
            dim=group.ncols,
            dtype=self.group_dtypes[group.name],
            implementation=self.implementation,
        )

    def _gather_rows(self, group, table, rows, valid):
        """Dequantized rows of a shard, one per id (a pooled lookup of one-id bags)."""
        n = rows.shape[0]
        seg = jnp.where(valid, jnp.arange(n, dtype=jnp.int32), n)
        return self._pooled_lookup(group, table, rows, seg, n, None)

    # ----- what a quantized collection cannot do -----
    def state_dict(self):
        raise NotImplementedError(
            "a sharded quantized collection has no logical float tables; keep the "
            "unsharded QuantEmbeddingBagCollection (or the float model) for state_dict"
        )

    def load_state_dict(self, state_dict):
        raise NotImplementedError("shard a new quantized collection instead")

    def init_optimizer_state(self, optimizer, path):
        raise TypeError("quantized collections are inference-only: they have no optimizer")

    def apply_sparse_gradients(self, *args, **kwargs):
        raise TypeError("quantized collections are inference-only: they cannot be trained")

    def table_bytes(self) -> int:
        """Bytes of every (global) quantized buffer, padding rows included."""
        return sum(int(v.get_value().nbytes) for v in self.weights.values())


class ShardedQuantEmbeddingBagCollection(_QuantShards, ShardedEmbeddingBagCollection):
    """A quantized ``EmbeddingBagCollection`` sharded per a plan (TorchRec's
    ``ShardedQuantEmbeddingBagCollection``). No variable batch per key (VBE).

    Args:
        module: a :class:`QuantEmbeddingBagCollection` (its rows are reused;
            column shards requantized), or a float ``EmbeddingBagCollection``
            (every shard quantized from the float rows, to ``dtype``).
        plan, mesh, options (capacity, overflow, pooling_factors, qcomms ...): as
            ``ShardedEmbeddingBagCollection``
            (inputs from ``jaxrec.distributed.shard_batch``; output
            ``[world * B, sum(D)]`` sharded over the batch).
        dtype, per_table_dtype, row_alignment: quantization of a float ``module``.
    """

    vbe = False  # quantized serving: a plain batch

    def __init__(
        self,
        module: QuantEmbeddingBagCollection | EmbeddingBagCollection,
        plan: Mapping[str, ParameterSharding],
        mesh: jax.sharding.Mesh,
        *,
        dtype: QuantDType | None = None,
        per_table_dtype: Mapping[str, QuantDType] | None = None,
        row_alignment: int = DEFAULT_ROW_ALIGNMENT,
        **options: Unpack[ShardOptions],
    ):
        self._setup_quant(module, dtype, per_table_dtype, row_alignment)
        super().__init__(module, plan, mesh, **options)

    def _dp_lookup(self, table, kjt, rg, out):
        pooled = quant_grouped_pooled_lookup(
            table,
            kjt,
            rg.slots,
            dim=rg.embedding_dim,
            dtype=self.group_dtypes[self.dp_buffer(rg)],
            is_weighted=self._is_weighted,
            bounds_check_mode=self.bounds_check_mode,
            implementation=self.implementation,
        )
        cols = dist.column_offsets(self.layout)
        for j, o in enumerate(self._dp_outputs(rg)):
            out[0] = out[0].at[:, cols[o] : cols[o + 1]].set(pooled[:, j])


class ShardedQuantEmbeddingCollection(_QuantShards, ShardedEmbeddingCollection):
    """A quantized ``EmbeddingCollection`` sharded per a plan; outputs as
    ``ShardedEmbeddingCollection`` (one local JaggedTensor per device, stacked).
    Arguments as :class:`ShardedQuantEmbeddingBagCollection`."""

    def __init__(
        self,
        module: QuantEmbeddingCollection | EmbeddingCollection,
        plan: Mapping[str, ParameterSharding],
        mesh: jax.sharding.Mesh,
        *,
        dtype: QuantDType | None = None,
        per_table_dtype: Mapping[str, QuantDType] | None = None,
        row_alignment: int = DEFAULT_ROW_ALIGNMENT,
        **options: Unpack[ShardOptions],
    ):
        self._setup_quant(module, dtype, per_table_dtype, row_alignment)
        super().__init__(module, plan, mesh, **options)

    def _dp_lookup(self, table, kjt, rg, out):
        rows = quant_grouped_sequence_lookup(
            table,
            kjt,
            rg.slots,
            dim=rg.embedding_dim,
            dtype=self.group_dtypes[self.dp_buffer(rg)],
            bounds_check_mode=self.bounds_check_mode,
        )
        for o, r in zip(self._dp_outputs(rg), rows, strict=True):
            out[o] = r


SHARDERS.setdefault(QuantEmbeddingBagCollection, ShardedQuantEmbeddingBagCollection)
SHARDERS.setdefault(QuantEmbeddingCollection, ShardedQuantEmbeddingCollection)
_FLOAT_SHARDERS = {
    EmbeddingBagCollection: ShardedQuantEmbeddingBagCollection,
    EmbeddingCollection: ShardedQuantEmbeddingCollection,
}


def shard_quant_model(
    model: nnx.Module,
    plan: ShardingPlan,
    mesh: jax.sharding.Mesh,
    *,
    dtype: QuantDType | None = None,
    per_table_dtype: Mapping[str, QuantDType] | None = None,
    row_alignment: int = DEFAULT_ROW_ALIGNMENT,
    capacity: int | None = None,
    overflow: str = "exact",
) -> nnx.Module:
    """Shards a model for quantized inference, in place (as ``DistributedModelParallel``).

    Quantized collections (from :func:`quantize_inference_model`) are sharded
    as they are. With ``dtype``, float collections named in the plan are
    quantized shard by shard from their float rows (the more accurate path for
    column-wise shards); ``per_table_dtype`` overrides ``dtype`` per table.
    Everything else is replicated over ``mesh``. Feed batches from
    ``jaxrec.distributed.shard_batch``.
    """
    found = set()
    for path, module in list(nnx.iter_modules(model)):
        name = ".".join(map(str, path))
        if name not in plan.plan:
            continue
        if isinstance(module, _QUANT):
            kwargs = {}
        elif dtype is not None or per_table_dtype:
            if type(module) not in _FLOAT_SHARDERS:
                continue
            assert isinstance(module, EmbeddingBagCollection | EmbeddingCollection)  # (its keys)
            names = {t.name for t in module.table_configs}
            mine = {k: v for k, v in (per_table_dtype or {}).items() if k in names}
            kwargs = dict(dtype=dtype, per_table_dtype=mine, row_alignment=row_alignment)
        else:
            continue
        sharder = _FLOAT_SHARDERS.get(type(module)) or SHARDERS[type(module)]
        sharded = sharder(
            module, plan.plan[name], mesh, capacity=capacity, overflow=overflow, **kwargs
        )
        replace_collection(model, path, sharded)
        found.add(name)
    unknown = sorted(set(plan.plan) - found)
    if unknown:
        raise ValueError(
            f"the plan names modules {unknown} that are not quantized collections of the "
            "model (pass dtype= to quantize float collections while sharding)"
        )
    replicated = NamedSharding(mesh, P())
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if not any(str(p) in ("weights", "overflow_count") for p in path):
            var.set_value(jax.device_put(var.get_value(), replicated))
    return model
