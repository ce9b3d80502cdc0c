"""Quantized embedding collections (TorchRec's ``torchrec.quant`` EBC / EC) and
``quantize_inference_model``.

Tables are stored as ``uint8`` rows in FBGEMM's TBE inference layout
(:mod:`jaxrec.xla.quantize`), stacked per ``(embedding_dim, dtype)``
group like the float collections; lookups gather packed rows and dequantize
only those (:mod:`jaxrec.inference.quant_ops`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from ..configs import BaseEmbeddingConfig, get_embedding_names_by_table
from ..embedding.collection import replace_collection
from ..embedding.tables import group_tables
from ..modules.embedding_bag_collection import EmbeddingBagCollection
from ..modules.embedding_collection import EmbeddingCollection
from ..ops import BoundsCheckMode, Implementation
from ..sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from ..xla.quantize import (
    DEFAULT_ROW_ALIGNMENT,
    QuantDType,
    canonical_dtype,
    quantize_rows,
    row_bytes,
)
from .quant_ops import quant_grouped_pooled_lookup, quant_grouped_sequence_lookup

quantize_jit = quantize_rows  # already jitted (dtype, row_alignment static); sharded.py imports it


class QuantTable(nnx.Variable):
    """Quantized ``[rows, row_bytes]`` uint8 table rows (not trainable, not an ``nnx.Param``)."""


def table_dtypes(
    tables: Sequence[BaseEmbeddingConfig],
    dtype: QuantDType,
    per_table_dtype: Mapping[str, QuantDType] | None,
) -> dict[str, str]:
    """``{table: canonical dtype}``; unknown table names in ``per_table_dtype`` raise."""
    per_table_dtype = dict(per_table_dtype or {})
    unknown = sorted(set(per_table_dtype) - {t.name for t in tables})
    if unknown:
        raise ValueError(
            f"per_table_dtype names tables {unknown} that are not in the collection "
            f"(tables: {[t.name for t in tables]})"
        )
    return {t.name: canonical_dtype(per_table_dtype.get(t.name, dtype)) for t in tables}


class QuantStorage(nnx.Module):
    """Stacked quantized buffers plus TorchRec-style per-table views.

    Args:
        tables: float table configs (shapes, features, pooling).
        quantized: ``{table: [num_embeddings, row_bytes] uint8}`` TBE rows.
        dtypes: ``{table: "int8" | "int4" | "fp16" | "bf16" | "fp32"}``.
        prefix: ``state_dict`` key prefix.
        row_alignment: the rows' byte alignment (all tables share it).
        bounds_check_mode, implementation: as the float collections.
    """

    def __init__(
        self,
        tables: Sequence[BaseEmbeddingConfig],
        quantized: Mapping[str, jax.typing.ArrayLike],
        dtypes: Mapping[str, QuantDType],
        *,
        prefix: str,
        row_alignment: int = DEFAULT_ROW_ALIGNMENT,
        bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
        implementation: Implementation = None,
    ):
        self.table_configs = tuple(tables)
        self.data_types = {t.name: canonical_dtype(dtypes[t.name]) for t in tables}
        self.row_alignment = row_alignment
        self.groups = group_tables(self.table_configs, self.data_types)
        self.prefix = prefix
        self.bounds_check_mode = BoundsCheckMode(bounds_check_mode)
        self.implementation: Implementation = implementation
        self.embedding_names = tuple(n for ns in get_embedding_names_by_table(tables) for n in ns)
        buffers = {}
        for g in self.groups:
            width = row_bytes(g.embedding_dim, g.dtype, row_alignment)
            pieces = []
            for name in g.tables:
                q = jnp.asarray(quantized[name])
                t = self.config(name)
                if q.dtype != jnp.uint8 or q.shape != (t.num_embeddings, width):
                    raise ValueError(
                        f"table {name!r}: expected [{t.num_embeddings}, {width}] uint8 "
                        f"({g.dtype}, dim {g.embedding_dim}), got {q.shape=} {q.dtype=}"
                    )
                pieces.append(q)
            buffers[g.name] = QuantTable(jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0])
        self.qweights = nnx.Dict(buffers)

    def config(self, name: str) -> BaseEmbeddingConfig:
        """The config of table ``name``."""
        return next(t for t in self.table_configs if t.name == name)

    def state_dict(self) -> dict[str, jax.Array]:
        """``{"<prefix>.<table>.weight": [num_embeddings, row_bytes] uint8}`` (TorchRec's shape)."""
        out = {}
        for g in self.groups:
            buf = self.qweights[g.name].get_value()
            for name, lo in zip(g.tables, g.row_offsets, strict=True):
                n = self.config(name).num_embeddings
                out[f"{self.prefix}.{name}.weight"] = buf[lo : lo + n]
        return out

    def table_bytes(self) -> int:
        """Bytes of every quantized buffer together."""
        return sum(int(v.get_value().nbytes) for v in self.qweights.values())


def _quantize_module(module, dtype, per_table_dtype, row_alignment) -> tuple[dict, dict]:
    dtypes = table_dtypes(module.table_configs, dtype, per_table_dtype)
    state = module.state_dict()
    quantized = {
        t.name: quantize_jit(
            state[f"{module.prefix}.{t.name}.weight"],
            dtype=dtypes[t.name],
            row_alignment=row_alignment,
        )
        for t in module.table_configs
    }
    return quantized, dtypes


class QuantEmbeddingBagCollection(QuantStorage):
    """A quantized ``EmbeddingBagCollection`` (TorchRec's ``torchrec.quant`` EBC).

    Same call as the float module: a ``KeyedJaggedTensor`` in, a ``KeyedTensor``
    ``[B, sum(D)]`` out. Build one with :meth:`from_float` (or
    :func:`quantize_inference_model` for a whole model).

    Example:
        >>> qebc = QuantEmbeddingBagCollection.from_float(ebc, dtype="int8")
        >>> qebc(kjt).values().shape  # as ebc(kjt)
    """

    def __init__(
        self,
        tables: Sequence[BaseEmbeddingConfig],
        quantized: Mapping[str, jax.typing.ArrayLike],
        dtypes: Mapping[str, QuantDType],
        is_weighted: bool = False,
        *,
        output_dtype: DTypeLike = jnp.float32,
        row_alignment: int = DEFAULT_ROW_ALIGNMENT,
        bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
        implementation: Implementation = None,
    ):
        super().__init__(
            tables,
            quantized,
            dtypes,
            prefix="embedding_bags",
            row_alignment=row_alignment,
            bounds_check_mode=bounds_check_mode,
            implementation=implementation,
        )
        self._is_weighted = is_weighted
        self.dtype = output_dtype
        self.length_per_embedding = tuple(t.embedding_dim for t in tables for _ in t.feature_names)

    @classmethod
    def from_float(
        cls,
        ebc: EmbeddingBagCollection,
        dtype: QuantDType = "int8",
        *,
        per_table_dtype: Mapping[str, QuantDType] | None = None,
        output_dtype: DTypeLike | None = None,
        row_alignment: int = DEFAULT_ROW_ALIGNMENT,
        implementation: Implementation = None,
    ) -> QuantEmbeddingBagCollection:
        """Quantizes every table of ``ebc`` (``per_table_dtype`` overrides ``dtype`` per table)."""
        quantized, dtypes = _quantize_module(ebc, dtype, per_table_dtype, row_alignment)
        return cls(
            ebc.table_configs,
            quantized,
            dtypes,
            ebc.is_weighted(),
            output_dtype=ebc.dtype if output_dtype is None else output_dtype,
            row_alignment=row_alignment,
            bounds_check_mode=ebc.bounds_check_mode,
            implementation=ebc.implementation if implementation is None else implementation,
        )

    def __call__(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        features.require_uniform_stride(type(self).__name__)
        features = features.narrow_ids()  # id words -> int32 rows; wide ids out of range
        pieces: list = [None] * len(self.embedding_names)
        for g in self.groups:
            p = quant_grouped_pooled_lookup(
                self.qweights[g.name].get_value(),
                features,
                g.slots,
                dim=g.embedding_dim,
                dtype=g.dtype,
                is_weighted=self._is_weighted,
                bounds_check_mode=self.bounds_check_mode,
                implementation=self.implementation,
            )  # [B, S_g, D_g]
            for j, out in enumerate(g.outputs):
                pieces[out] = p[:, j, :]
        values = jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0]
        return KeyedTensor(
            self.embedding_names, self.length_per_embedding, values.astype(self.dtype)
        )

    def embedding_bag_configs(self) -> list:
        return list(self.table_configs)

    def is_weighted(self) -> bool:
        return self._is_weighted


class QuantEmbeddingCollection(QuantStorage):
    """A quantized ``EmbeddingCollection``: ``{embedding_name: JaggedTensor}`` of
    dequantized ``[C_k, D]`` float rows (padding rows zero), as the float module."""

    def __init__(
        self,
        tables: Sequence[BaseEmbeddingConfig],
        quantized: Mapping[str, jax.typing.ArrayLike],
        dtypes: Mapping[str, QuantDType],
        need_indices: bool = False,
        *,
        output_dtype: DTypeLike = jnp.float32,
        row_alignment: int = DEFAULT_ROW_ALIGNMENT,
        bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
        implementation: Implementation = None,
    ):
        super().__init__(
            tables,
            quantized,
            dtypes,
            prefix="embeddings",
            row_alignment=row_alignment,
            bounds_check_mode=bounds_check_mode,
            implementation=implementation,
        )
        self._need_indices = need_indices
        self.dtype = output_dtype

    @classmethod
    def from_float(
        cls,
        ec: EmbeddingCollection,
        dtype: QuantDType = "int8",
        *,
        per_table_dtype: Mapping[str, QuantDType] | None = None,
        output_dtype: DTypeLike | None = None,
        row_alignment: int = DEFAULT_ROW_ALIGNMENT,
        implementation: Implementation = None,
    ) -> QuantEmbeddingCollection:
        """Quantizes every table of ``ec`` (``per_table_dtype`` overrides ``dtype`` per table)."""
        quantized, dtypes = _quantize_module(ec, dtype, per_table_dtype, row_alignment)
        return cls(
            ec.table_configs,
            quantized,
            dtypes,
            ec.need_indices(),
            output_dtype=ec.dtype if output_dtype is None else output_dtype,
            row_alignment=row_alignment,
            bounds_check_mode=ec.bounds_check_mode,
            implementation=ec.implementation if implementation is None else implementation,
        )

    def __call__(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        features = features.narrow_ids()  # id words -> int32 rows; wide ids out of range
        rows: list = [None] * len(self.embedding_names)
        for g in self.groups:
            per_slot = quant_grouped_sequence_lookup(
                self.qweights[g.name].get_value(),
                features,
                g.slots,
                dim=g.embedding_dim,
                dtype=g.dtype,
                bounds_check_mode=self.bounds_check_mode,
            )
            for out, slot, emb in zip(g.outputs, g.slots, per_slot, strict=True):
                rows[out] = (slot.key, emb)
        result = {}
        for name, (key, emb) in zip(self.embedding_names, rows, strict=True):
            jt = features[key]
            ids = jt.values() if self._need_indices else None
            result[name] = JaggedTensor.from_parts(emb.astype(self.dtype), jt.lengths(), ids)
        return result

    def embedding_configs(self) -> list:
        return list(self.table_configs)

    def need_indices(self) -> bool:
        return self._need_indices


QUANTIZERS: dict[type, Callable] = {
    EmbeddingBagCollection: QuantEmbeddingBagCollection.from_float,
    EmbeddingCollection: QuantEmbeddingCollection.from_float,
}


def quantize_inference_model(
    model: nnx.Module,
    *,
    dtype: QuantDType = "int8",
    per_table_dtype: Mapping[str, QuantDType] | None = None,
    output_dtype: DTypeLike | None = None,
    row_alignment: int = DEFAULT_ROW_ALIGNMENT,
    implementation: Implementation = None,
) -> nnx.Module:
    """A copy of ``model`` whose embedding collections are quantized (TorchRec's name).

    Every ``EmbeddingBagCollection`` becomes a :class:`QuantEmbeddingBagCollection`
    and every ``EmbeddingCollection`` a :class:`QuantEmbeddingCollection`, wherever
    they sit in the module tree; the rest of the model is copied unchanged, and
    ``model`` itself is left alone.

    Args:
        model: any ``nnx.Module`` (e.g. ``jaxrec.models.DLRM``).
        dtype: table type for every table: ``"int8"`` (default), ``"int4"``,
            ``"fp16"``, ``"bf16"`` or ``"fp32"``.
        per_table_dtype: ``{table_name: dtype}`` overrides; a name applies to
            every collection that has such a table, and must exist in one.
        output_dtype: dtype of the collections' outputs (default: as before).
        row_alignment: byte alignment of the quantized rows (TorchRec's 16).
        implementation: lookup implementation (default: the float module's).

    Example:
        >>> qmodel = quantize_inference_model(dlrm, dtype="int8")
        >>> qmodel(dense, kjt)  # as dlrm(dense, kjt), within the quantization error
    """
    model = nnx.clone(model)
    per_table_dtype = dict(per_table_dtype or {})
    seen: set[str] = set()
    for path, module in list(nnx.iter_modules(model)):
        quantizer = QUANTIZERS.get(type(module))
        if quantizer is None:
            continue
        assert isinstance(module, EmbeddingBagCollection | EmbeddingCollection)  # QUANTIZERS' keys
        names = {t.name for t in module.table_configs}
        mine = {k: v for k, v in per_table_dtype.items() if k in names}
        seen |= set(mine)
        quant = quantizer(
            module,
            dtype,
            per_table_dtype=mine,
            output_dtype=output_dtype,
            row_alignment=row_alignment,
            implementation=implementation,
        )
        if not path:
            return quant
        replace_collection(model, path, quant)
    unknown = sorted(set(per_table_dtype) - seen)
    if unknown:
        raise ValueError(f"per_table_dtype names tables {unknown} found in no embedding collection")
    return model
