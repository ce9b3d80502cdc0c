"""EmbeddingBagCollection: pooled lookups of many tables, one gather per table group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..configs import EmbeddingBagConfig, check_tables
from ..embedding.tables import TableStorage
from ..embedding.tape import tap
from ..ops import BoundsCheckMode, grouped_pooled_lookup
from ..sparse import KeyedJaggedTensor, KeyedTensor


class EmbeddingBagCollection(TableStorage):
    """A collection of pooled embedding tables (TorchRec's ``EmbeddingBagCollection``).

    Takes a ``KeyedJaggedTensor`` of form ``[F x B x L]`` and returns a
    ``KeyedTensor`` whose values are ``[B, sum(D)]``: one pooled vector per
    feature, in table order then feature order. A feature read by several
    tables appears once per table as ``"<feature>@<table>"``.

    ::

        #        0       1        2  <-- batch
        # "f1"   [0,1]   None     [2]       -> t1 (D=3):  [B, 3]
        # "f2"   [3]     [4]      [5,6,7]   -> t2 (D=4):  [B, 4]
        #                                      output:    [B, 7], keys ["f1", "f2"]

    Args:
        tables: ``EmbeddingBagConfig`` per table.
        is_weighted: multiply rows by the KJT's per-sample weights.
        rngs: ``nnx.Rngs`` for initialisation (``rngs.params``).
        dtype: output dtype (accumulation is always float32).
        bounds_check_mode: out-of-range id handling (default WARNING: dropped and logged).
        implementation: ``None`` (Pallas on GPU when available), ``"xla"`` or ``"pallas"``.

    Example:
        >>> ebc = EmbeddingBagCollection(
        ...     [EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10)],
        ...     rngs=nnx.Rngs(0))
        >>> kjt = KeyedJaggedTensor(keys=["t1"], values=[0, 1, 2], lengths=[2, 0, 1])
        >>> ebc(kjt).values().shape
        (3, 3)
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        *,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
        implementation: str | None = None,
    ):
        tables = check_tables(tables, EmbeddingBagConfig)
        super().__init__(
            tables,
            prefix="embedding_bags",
            rngs=rngs,
            bounds_check_mode=bounds_check_mode,
            implementation=implementation,
        )
        self._is_weighted = is_weighted
        self.dtype = dtype
        self.length_per_embedding = tuple(t.embedding_dim for t in tables for _ in t.feature_names)

    def __call__(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings ``[B, sum(D)]`` as a KeyedTensor keyed by embedding name."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        pooled = [
            grouped_pooled_lookup(
                self.weights[g.name].get_value(),
                features,
                g.slots,
                is_weighted=self._is_weighted,
                bounds_check_mode=self.bounds_check_mode,
                implementation=self.implementation,
            )  # [B, S_g, D_g]
            for g in self.groups
        ]
        if len(pooled) == 1:  # one group holds every table, already in output order
            values = pooled[0].reshape(pooled[0].shape[0], sum(self.length_per_embedding))
        else:
            pieces: list = [None] * len(self.embedding_names)
            for g, p in zip(self.groups, pooled, strict=True):
                for j, out in enumerate(g.outputs):
                    pieces[out] = p[:, j, :]
            values = jnp.concatenate(pieces, axis=1)
        values = tap(self, values, features)  # a train step's gradient probe
        return KeyedTensor(
            self.embedding_names, self.length_per_embedding, values.astype(self.dtype)
        )

    def output_columns(self) -> tuple[int, ...]:
        """Static start column of each embedding in the output values, plus the end."""
        return tuple(np.cumsum([0, *self.length_per_embedding]).tolist())

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self.table_configs)

    def is_weighted(self) -> bool:
        return self._is_weighted
