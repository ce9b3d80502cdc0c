"""EmbeddingCollection: unpooled (sequence) lookups, one gather per table group."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from ..configs import EmbeddingConfig, check_tables, get_embedding_names_by_table
from ..embedding.collection import GradSource, LookupGrad
from ..embedding.tables import TableGroup, TableStorage
from ..embedding.tape import tap
from ..ops import BoundsCheckMode, Implementation, grouped_sequence_lookup
from ..sparse import JaggedTensor, KeyedJaggedTensor
from ..xla.backward import sequence_grad_sources


class EmbeddingCollection(TableStorage):
    """A collection of sequence embedding tables (TorchRec's ``EmbeddingCollection``).

    Returns ``{embedding_name: JaggedTensor}`` whose values are ``[C_k, D]``
    (one row per id, the feature's capacity; padding rows are zero) and whose
    lengths are the feature's lengths. With ``need_indices`` the ids are
    returned in the JaggedTensor's ``weights`` slot, as TorchRec does. Tables
    may have different dims (TorchRec requires one); ``embedding_dim()`` then
    raises.

    Args:
        tables: ``EmbeddingConfig`` per table.
        need_indices: also return the ids of each feature.
        rngs: ``nnx.Rngs`` for initialisation.
        dtype: output dtype (rows are gathered in the table dtype, then cast).
        bounds_check_mode: out-of-range id handling (default WARNING: zero rows, logged).
        implementation: ``None``, ``"xla"``, ``"pallas"``, ``"cpu"`` or
            ``"mosaic_gpu"``
            (``jaxrec.ops.Implementation``).
    """

    table_configs: tuple[EmbeddingConfig, ...]  # as given: TableStorage keeps them

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        need_indices: bool = False,
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike = jnp.float32,
        bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
        implementation: Implementation = None,
    ):
        tables = check_tables(tables, EmbeddingConfig)
        super().__init__(
            tables,
            prefix="embeddings",
            rngs=rngs,
            bounds_check_mode=bounds_check_mode,
            implementation=implementation,
        )
        self._need_indices = need_indices
        self.dtype = dtype

    def __call__(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        features = features.narrow_ids()  # id words -> int32 rows; wide ids out of range
        rows: list = [None] * len(self.embedding_names)
        for g in self.groups:
            per_slot = grouped_sequence_lookup(
                self.weights[g.name].get_value(),
                features,
                g.slots,
                bounds_check_mode=self.bounds_check_mode,
                implementation=self.implementation,
            )
            for out, slot, emb in zip(g.outputs, g.slots, per_slot, strict=True):
                rows[out] = (slot.key, emb)
        tapped = tap(self, tuple(emb for _, emb in rows), features)  # train-step probe
        rows = [(key, emb) for (key, _), emb in zip(rows, tapped, strict=True)]
        result = {}
        for name, (key, emb) in zip(self.embedding_names, rows, strict=True):
            jt = features[key]
            ids = jt.values() if self._need_indices else None
            result[name] = JaggedTensor.from_parts(emb.astype(self.dtype), jt.lengths(), ids)
        return result

    def grad_source(self, group: TableGroup, call: LookupGrad) -> GradSource:
        """One output row per id: the group's slots' output rows, concatenated."""
        flat = jnp.concatenate([call.grad[o] for o in group.outputs])
        rows, seg, scale, valid = sequence_grad_sources(call.features, group.slots)
        return GradSource(out_grad=flat, seg=seg, scale=scale, rows=rows, valid=valid)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self.table_configs)

    def embedding_dim(self) -> int:
        dims = {t.embedding_dim for t in self.table_configs}
        if len(dims) != 1:
            raise ValueError(
                f"tables have several embedding dims {sorted(dims)}; there is no single one"
            )
        return dims.pop()

    def embedding_names_by_table(self) -> list[list[str]]:
        return get_embedding_names_by_table(self.table_configs)

    def need_indices(self) -> bool:
        return self._need_indices
