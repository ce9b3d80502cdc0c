"""EmbeddingBagCollection: pooled lookups of many tables, one gather per table group."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from ..configs import EmbeddingBagConfig, check_tables
from ..embedding.collection import GradSource, LookupGrad
from ..embedding.tables import TableGroup, TableStorage
from ..embedding.tape import tap
from ..ops import BoundsCheckMode, Implementation, expand_slots, grouped_pooled_lookup
from ..ops.dispatch import try_cpu
from ..sparse import KeyedJaggedTensor, KeyedTensor
from ..xla.backward import pooled_grad_sources


class EmbeddingBagCollection(TableStorage):
    """A collection of pooled embedding tables (TorchRec's ``EmbeddingBagCollection``).

    Takes a ``KeyedJaggedTensor`` of form ``[F x B x L]`` and returns a
    ``KeyedTensor`` whose values are ``[B, sum(D)]``: one pooled vector per
    feature, in table order then feature order. A feature read by several
    tables appears once per table as ``"<feature>@<table>"``.

    A variable batch per key (VBE: ``stride_per_key``, ``inverse_indices``; see
    ``KeyedJaggedTensor``) is looked up on each key's ``B_k`` bags and expanded
    to the ``B`` samples afterwards, so a train step's backward also runs on
    the ``B_k`` bags (TorchRec's VBE).

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
        implementation: ``None`` (C++ kernels on CPU, Pallas on GPU, XLA elsewhere), ``"xla"``,
            ``"pallas"``, ``"cpu"`` or
            ``"mosaic_gpu"`` (see ``jaxrec.ops.Implementation``).

    Example:
        >>> ebc = EmbeddingBagCollection(
        ...     [EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10)],
        ...     rngs=nnx.Rngs(0))
        >>> kjt = KeyedJaggedTensor(keys=["t1"], values=[0, 1, 2], lengths=[2, 0, 1])
        >>> ebc(kjt).values().shape
        (3, 3)
    """

    table_configs: tuple[EmbeddingBagConfig, ...]  # as given: TableStorage keeps them

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike = jnp.float32,
        bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
        implementation: Implementation = None,
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
        features = features.narrow_ids()  # id words -> int32 rows; wide ids out of range
        if features.variable_stride_per_key():
            return self._call_vbe(features)
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
        b = pooled[0].shape[0]
        values = jnp.concatenate([p.reshape(b, p.shape[1] * p.shape[2]) for p in pooled], axis=1)
        order = self._group_order()
        if order is not None:  # one gather into output order, not a slice per feature
            values = jnp.take(values, order, axis=1)
        values = tap(self, values, features)  # a train step's gradient probe
        return KeyedTensor(
            self.embedding_names, self.length_per_embedding, values.astype(self.dtype)
        )

    def _call_vbe(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled ``[sum_j B_j, D_g]`` per group, tapped small, then expanded to
        ``[B, sum(D)]`` by one row gather per group (its gradient: a segment sum)."""
        pooled = {
            g.name: grouped_pooled_lookup(
                self.weights[g.name].get_value(),
                features,
                g.slots,
                is_weighted=self._is_weighted,
                bounds_check_mode=self.bounds_check_mode,
                implementation=self.implementation,
            )  # [sum_j B_j, D_g]
            for g in self.groups
        }
        pooled = tap(self, pooled, features)  # the step's backward runs on the B_k bags
        values = jnp.concatenate(
            [expand_slots(pooled[g.name], features, g.slots) for g in self.groups], axis=1
        )
        order = self._group_order()
        if order is not None:
            values = jnp.take(values, order, axis=1)
        return KeyedTensor(
            self.embedding_names, self.length_per_embedding, values.astype(self.dtype)
        )

    def _group_order(self) -> np.ndarray | None:
        """Static output column of each column of the groups' outputs laid side by side
        (``None`` when they already are in output order)."""
        cols = self.output_columns()
        order = np.concatenate(
            [np.arange(cols[o], cols[o + 1]) for g in self.groups for o in g.outputs]
        )
        inverse = np.argsort(order)
        return None if np.array_equal(inverse, np.arange(len(order))) else inverse

    def output_columns(self) -> tuple[int, ...]:
        """Static start column of each embedding in the output values, plus the end."""
        return tuple(np.cumsum([0, *self.length_per_embedding]).tolist())

    # ----- the train step's sparse update (see TableStorage) -----
    def grad_source(self, group: TableGroup, call: LookupGrad) -> GradSource:
        """Bag ``b``'s output columns of slot ``j`` are row ``b * S + j`` of the
        source; every id of the bag adds that row (times its scale)."""
        if call.features.variable_stride_per_key():  # the tapped [sum_j B_j, D] per group
            rows, seg, scale, valid = pooled_grad_sources(
                call.features, group.slots, is_weighted=self._is_weighted
            )
            out_grad = call.grad[group.name].astype(jnp.float32)
            return GradSource(out_grad=out_grad, seg=seg, scale=scale, rows=rows, valid=valid)
        cols = self.output_columns()
        idx = np.concatenate([np.arange(cols[o], cols[o + 1]) for o in group.outputs])
        g = jnp.take(call.grad, idx, axis=1)  # one gather, not a slice per feature
        flat = g.reshape(g.shape[0] * len(group.outputs), group.embedding_dim)  # [B * S, D]
        rows, seg, scale, valid = pooled_grad_sources(
            call.features, group.slots, is_weighted=self._is_weighted
        )
        return GradSource(out_grad=flat, seg=seg, scale=scale, rows=rows, valid=valid)

    def fused_backward_update(
        self, optimizer, group, table, state, calls, source, *, dep, implementation=None
    ):
        """One call: where the program runs on CPU, the C++ kernel reads the KJT and the
        output gradient directly (``source``, traced for the other platforms, is then
        dead code, which XLA drops)."""
        generic = functools.partial(
            super().fused_backward_update,
            optimizer,
            group,
            table,
            state,
            calls,
            source,
            dep=dep,
            implementation=implementation,
        )
        if len(calls) != 1 or calls[0].features.variable_stride_per_key():
            return generic()
        cols = self.output_columns()
        return try_cpu(
            "kjt_backward_update",
            implementation,
            generic,
            optimizer,
            table,
            state,
            calls[0].grad,
            calls[0].features,
            group.slots,
            tuple(cols[o] for o in group.outputs),
            is_weighted=self._is_weighted,
            dep=dep,
        )

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self.table_configs)

    def is_weighted(self) -> bool:
        return self._is_weighted
