"""Stacked table storage shared by the embedding collections (FBGEMM's TBE layout).

Tables sharing ``(embedding_dim, dtype)`` live in one ``[sum(num_embeddings), D]``
buffer per group; ``state_dict`` shows them per table, in TorchRec's keys.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..configs import BaseEmbeddingConfig, PoolingType, get_embedding_names_by_table
from ..ops import BoundsCheckMode, FeatureSlot, Implementation
from ..ops.init import TablePiece, uniform_rows
from ..xla.backward import dedup_rows, source_grads
from .blocks import Block, TableBlocks
from .collection import EmbeddingCollectionInterface, GradSource, LookupGrad
from .optimizer import state_key
from .sparse_update import backward_update, reset_state_rows, subgroup_rows, update_subgroup


@dataclasses.dataclass
class _Recording:
    keys: dict[int, jax.Array]
    draw: bool


_RECORDING: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar(
    "jaxrec_init_keys", default=None
)


@contextlib.contextmanager
def recording_init_keys(*, draw: bool = True) -> Iterator[dict[int, jax.Array]]:
    """Inside, every collection built records the key its tables draw from, under
    ``id(collection)``: what a sharded build needs to draw each shard where it lives
    (``jaxrec.distributed.DistributedModelParallel`` of a model constructor). With
    ``draw=False`` (only under tracing: ``eval_shape``, or a ``jit`` whose outputs
    leave the tables out) tables are zeros of their shape, not drawn."""
    recording = _Recording({}, draw)
    token = _RECORDING.set(recording)
    try:
        yield recording.keys
    finally:
        _RECORDING.reset(token)


class EmbeddingTable(nnx.Variable):
    """Embedding weights. Deliberately not an ``nnx.Param``: dense optimizers
    filtering on ``nnx.Param`` skip tables, which get sparse updates instead."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableGroup:
    """Tables stacked in one buffer, and the feature slots that read them.

    ``outputs[i]`` is the position of ``slots[i]`` in the collection's output order.
    """

    name: str
    embedding_dim: int
    dtype: str
    tables: tuple[str, ...]
    row_offsets: tuple[int, ...]
    num_rows: int
    slots: tuple[FeatureSlot, ...]
    outputs: tuple[int, ...]

    @property
    def table_rows(self) -> tuple[int, ...]:
        """Rows of each table of the group (its ``num_embeddings``), in group order."""
        ends = (*self.row_offsets[1:], self.num_rows)
        return tuple(e - lo for lo, e in zip(self.row_offsets, ends, strict=True))


def group_tables(
    tables: Sequence[BaseEmbeddingConfig], dtypes: Mapping[str, str] | None = None
) -> tuple[TableGroup, ...]:
    """Groups tables by ``(embedding_dim, dtype)`` in first-seen order.

    ``dtypes`` (``{table: dtype name}``, e.g. the quantized collections' storage
    types) replaces the tables' own ``data_type``.
    """
    members: dict[tuple[int, str], list[int]] = {}
    for i, t in enumerate(tables):
        dtype = t.data_type.value if dtypes is None else dtypes[t.name]
        members.setdefault((t.embedding_dim, dtype), []).append(i)
    first_output = np.cumsum([0] + [t.num_features() for t in tables]).tolist()
    groups = []
    for (dim, dtype), idx in members.items():
        offsets, slots, outputs, row = [], [], [], 0
        for i in idx:
            t = tables[i]
            offsets.append(row)
            for j, feature in enumerate(t.feature_names):
                pooling = getattr(t, "pooling", PoolingType.SUM)  # sequence tables: unused
                slots.append(
                    FeatureSlot(
                        key=feature,
                        row_offset=row,
                        num_embeddings=t.num_embeddings,
                        pooling=pooling,
                    )
                )
                outputs.append(first_output[i] + j)
            row += t.num_embeddings
        groups.append(
            TableGroup(
                name=f"{dtype.lower()}_d{dim}",
                embedding_dim=dim,
                dtype=dtype,
                tables=tuple(tables[i].name for i in idx),
                row_offsets=tuple(offsets),
                num_rows=row,
                slots=tuple(slots),
                outputs=tuple(outputs),
            )
        )
    return tuple(groups)


def init_table(config: BaseEmbeddingConfig, key: jax.Array) -> jax.Array:
    """``[num_embeddings, embedding_dim]`` initial weights in the table's dtype."""
    shape = (config.num_embeddings, config.embedding_dim)
    if config.init_fn is not None:
        w = jnp.asarray(config.init_fn(key, shape, config.dtype))
        if w.shape != shape:
            raise ValueError(
                f"init_fn of table {config.name!r} returned {w.shape=}, expected {shape}"
            )
        return w.astype(config.dtype)
    lo, hi = config.get_weight_init_min(), config.get_weight_init_max()
    return jax.random.uniform(key, shape, jnp.float32, lo, hi).astype(config.dtype)


class TableStorage(EmbeddingCollectionInterface):
    """Grouped table buffers plus TorchRec-style per-table views.

    The unsharded side of :class:`EmbeddingCollectionInterface`: a subclass
    says how one call's output gradient maps to each group's ids
    (:meth:`grad_source`: pooled bags or one row per id).

    Args:
        tables: table configs, in the collection's order.
        prefix: ``state_dict`` key prefix (``"embedding_bags"`` or ``"embeddings"``).
        rngs: ``nnx.Rngs``; the collection draws one key from ``rngs.params`` and table
            ``i`` (in ``tables`` order) initialises from ``fold_in(key, i)``.
        bounds_check_mode: out-of-range id handling for lookups.
        implementation: ``None``, ``"xla"``, ``"pallas"``, ``"cpu"`` or
            ``"mosaic_gpu"``
            (``jaxrec.ops.Implementation``).
    """

    def __init__(
        self,
        tables: Sequence[BaseEmbeddingConfig],
        *,
        prefix: str,
        rngs: nnx.Rngs,
        bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
        implementation: Implementation = None,
    ):
        self.table_configs = tuple(tables)
        self.groups = group_tables(self.table_configs)
        self.prefix = prefix
        self.bounds_check_mode = BoundsCheckMode(bounds_check_mode)
        self.implementation: Implementation = implementation
        self.embedding_names = tuple(n for ns in get_embedding_names_by_table(tables) for n in ns)
        key = rngs.params()  # one draw per collection; table i is stream i of it
        recording = _RECORDING.get()
        if recording is not None:
            recording.keys[id(self)] = key
        draw = recording is None or recording.draw
        self.weights = nnx.Dict(
            {
                g.name: EmbeddingTable(
                    self.initial_weights(g, key)
                    if draw
                    else jnp.zeros((g.num_rows, g.embedding_dim), self.config(g.tables[0]).dtype)
                )
                for g in self.groups
            }
        )

    def config(self, name: str) -> BaseEmbeddingConfig:
        """The config of table ``name``."""
        return next(t for t in self.table_configs if t.name == name)

    def group(self, name: str) -> TableGroup:
        """The table group (stacked buffer) called ``name``."""
        return next(g for g in self.groups if g.name == name)

    def initial_weights(self, group: TableGroup, key: jax.Array) -> jax.Array:
        """The group's stacked initial weights: table ``i`` of the collection (its
        stream) draws TorchRec's uniform init from ``key`` by element
        (``jaxrec.ops.init``), so its values depend only on ``key`` and ``i``: not on
        its group, nor on which rows and columns a shard of it holds. A table with
        an ``init_fn`` gets ``init_fn(fold_in(key, i), shape, dtype)``."""
        index = {t.name: i for i, t in enumerate(self.table_configs)}
        configs = [self.config(n) for n in group.tables]
        pieces = [
            TablePiece(
                off,
                c.num_embeddings,
                index[c.name],
                0,
                0,
                c.embedding_dim,
                c.get_weight_init_min(),
                c.get_weight_init_max(),
            )
            for c, off in zip(configs, group.row_offsets, strict=True)
            if c.init_fn is None
        ]
        buf = uniform_rows(key, pieces, group.num_rows, group.embedding_dim, configs[0].dtype)
        for c, off in zip(configs, group.row_offsets, strict=True):
            if c.init_fn is not None:
                w = init_table(c, jax.random.fold_in(key, index[c.name]))
                buf = jax.lax.dynamic_update_slice(buf, w, (off, 0))
        return buf

    def reset_parameters(self, rngs: nnx.Rngs) -> None:
        key = rngs.params()
        for g in self.groups:
            self.weights[g.name].set_value(self.initial_weights(g, key))

    def locate(self, table: str) -> tuple[TableGroup, int, int]:
        """``(group, first row in the group's buffer, rows)`` of ``table``."""
        for g in self.groups:
            if table in g.tables:
                i = g.tables.index(table)
                return g, g.row_offsets[i], self.config(table).num_embeddings
        raise KeyError(table)

    def state_dict(self) -> dict[str, jax.Array]:
        """``{"<prefix>.<table>.weight": [num_embeddings, embedding_dim]}`` in table order."""
        parts = {}
        for g in self.groups:
            pieces = _split_rows(self.weights[g.name].get_value(), g.row_offsets[1:])
            parts.update(zip(g.tables, pieces, strict=True))
        return {f"{self.prefix}.{t.name}.weight": parts[t.name] for t in self.table_configs}

    def load_state_dict(
        self, state_dict: Mapping[str, jax.typing.ArrayLike], strict: bool = True
    ) -> None:
        """Sets table weights from TorchRec-style keys (numpy, JAX or torch-converted arrays).

        With ``strict``, every table must be given and no unknown key is allowed.
        """
        expected = {f"{self.prefix}.{t.name}.weight": t for t in self.table_configs}
        unknown = sorted(set(state_dict) - set(expected))
        missing = sorted(set(expected) - set(state_dict))
        if strict and (unknown or missing):
            raise ValueError(
                f"load_state_dict: missing keys {missing}, unexpected keys {unknown}; "
                f"expected exactly {sorted(expected)}"
            )
        for g in self.groups:
            pieces, changed = [], False
            current = self.weights[g.name].get_value()
            for name, lo in zip(g.tables, g.row_offsets, strict=True):
                t = self.config(name)
                key = f"{self.prefix}.{name}.weight"
                if key not in state_dict:
                    pieces.append(current[lo : lo + t.num_embeddings])
                    continue
                w = state_dict[key]
                w = w if isinstance(w, jax.Array) else np.asarray(w)
                shape = (t.num_embeddings, t.embedding_dim)
                if tuple(w.shape) != shape:
                    raise ValueError(f"{key}: expected shape {shape}, got {tuple(w.shape)}")
                pieces.append(jnp.asarray(w, t.dtype))
                changed = True
            if changed:  # one concatenation per group, not one copy per table
                self.weights[g.name].set_value(jnp.concatenate(pieces))

    # ----- training (the EmbeddingCollectionInterface) -----
    def grad_source(self, group: TableGroup, call: LookupGrad) -> GradSource:
        """How ``call``'s output gradient reaches the ids of ``group`` (per subclass)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement grad_source")

    def fused_backward_update(
        self,
        optimizer,
        group: TableGroup,
        table: jax.Array,
        state,
        calls: Sequence[LookupGrad],
        source: GradSource,
        *,
        dep: jax.Array,
        implementation: Implementation = None,
    ):
        """The backward of every call fused with ``optimizer``'s step over ``group``'s
        buffer (the one-optimizer case); ``source`` describes all ``calls``' ids."""
        del calls  # a subclass may read them directly (see EmbeddingBagCollection)
        return backward_update(
            optimizer,
            table,
            state,
            source.out_grad + 0.0 * dep,
            source.seg,
            source.scale,
            source.rows,
            source.valid,
            implementation=implementation,
        )

    def init_optimizer_state(self, optimizer, path: tuple) -> dict:
        out = {}
        for g in self.groups:
            for k, sub in enumerate(optimizer.subgroups(g)):
                out[state_key(path, g.name, k)] = sub.optimizer.init(sub.num_rows, g.embedding_dim)
        return out

    def apply_sparse_gradients(
        self, optimizer, path, weights, sparse_state, calls, *, dep, implementation=None
    ):
        weights, sparse_state = dict(weights), dict(sparse_state)
        sources = [[self.grad_source(g, call) for g in self.groups] for call in calls]
        for i, g in enumerate(self.groups):
            source = _concat_sources([per_call[i] for per_call in sources])
            subs = optimizer.subgroups(g)
            if len(subs) == 1 and subs[0].covers_group:  # one optimizer: the fused path
                key = state_key(path, g.name, 0)
                weights[g.name], sparse_state[key] = self.fused_backward_update(
                    subs[0].optimizer,
                    g,
                    weights[g.name],
                    sparse_state[key],
                    calls,
                    source,
                    dep=dep,
                    implementation=implementation,
                )
                continue
            grads = source_grads(
                source.out_grad + 0.0 * dep, source.seg, source.scale, source.valid
            )
            unique, summed = dedup_rows(source.rows, grads, source.valid, g.num_rows)
            for k, sub in enumerate(subs):
                key = state_key(path, g.name, k)
                weights[g.name], sparse_state[key] = update_subgroup(
                    sub,
                    g.row_offsets,
                    weights[g.name],
                    sparse_state[key],
                    unique,
                    summed,
                    implementation=implementation,
                )
        return weights, sparse_state

    def reset_optimizer_rows(self, optimizer, path, group, sparse_state, rows) -> dict:
        """As the interface says; ``count`` (one counter per group) is left alone, as
        FBGEMM's ``reset_embedding_weight_momentum`` leaves its step counter."""
        g = self.group(group)
        out = dict(sparse_state)
        for k, sub in enumerate(optimizer.subgroups(g)):
            key = state_key(path, g.name, k)
            _, state_rows = subgroup_rows(sub, g.row_offsets, rows, g.num_rows)
            out[key] = reset_state_rows(sub, out[key], state_rows, g.embedding_dim)
        return out

    # ----- where the tables sit (used by jaxrec.checkpoint) -----
    def table_blocks(self, optimizer, path: tuple) -> TableBlocks:
        """As the interface says: a group buffer stacks its tables' rows; a group split
        by optimizer keeps one state per subgroup over its member tables' rows."""
        weights, states = {}, {}
        for g in self.groups:
            dim = g.embedding_dim
            spans = list(zip(g.tables, g.row_offsets, g.table_rows, strict=True))
            weights[g.name] = tuple(Block(t, 0, n, 0, dim, lo) for t, lo, n in spans)
            for k, sub in enumerate(optimizer.subgroups(g)):
                states[state_key(path, g.name, k)] = tuple(
                    Block(t, 0, n, 0, dim, off)
                    for (t, _, n), m, off in zip(spans, sub.member, sub.state_offsets, strict=True)
                    if m
                )
        return TableBlocks(weights, states)


def _concat_sources(sources: Sequence[GradSource]) -> GradSource:
    """One gradient description from several calls' (output rows offset per call)."""
    if len(sources) == 1:
        return sources[0]
    offsets = np.cumsum([0] + [s.out_grad.shape[0] for s in sources[:-1]])
    return GradSource(
        out_grad=jnp.concatenate([s.out_grad for s in sources]),
        seg=jnp.concatenate([s.seg + int(o) for s, o in zip(sources, offsets, strict=True)]),
        scale=jnp.concatenate([s.scale for s in sources]),
        rows=jnp.concatenate([s.rows for s in sources]),
        valid=jnp.concatenate([s.valid for s in sources]),
    )


@functools.partial(jax.jit, static_argnums=1)
def _split_rows(buffer: jax.Array, cuts: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """A group buffer's tables in one program (eager slices compiled one per table)."""
    return tuple(jnp.split(buffer, cuts))
