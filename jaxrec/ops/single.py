"""Single-table lookups over plain arrays (no KeyedJaggedTensor, no Flax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..configs import PoolingType
from ..sparse.bags import finite_weights, valid_bags
from ..sparse.ids64 import narrow_ids
from ..sparse.jagged_tensor import segment_ids_from_lengths
from ..xla.bounds import BoundsCheckMode, check_ids
from .dispatch import Implementation
from .layout import report_bags, report_weights
from .pooled import embedding_bag, embedding_gather


def pooled_lookup(
    table: jax.Array,
    values: jax.Array,
    lengths: jax.Array,
    weights: jax.Array | None = None,
    *,
    pooling: PoolingType = PoolingType.SUM,
    bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
    implementation: Implementation = None,
) -> jax.Array:
    """``torch.nn.EmbeddingBag`` over a jagged batch.

    Args:
        table: ``[V, D]``.
        values: ``[C]`` ids (or ``uint32[C, 2]`` id words: an id past 31 bits is
            out of range); entries past ``sum(lengths)`` are padding.
        lengths: ``[B]`` bag lengths.
        weights: optional ``[C]`` per-sample weights.
        pooling: SUM or MEAN (MEAN of an empty bag is zero).
        bounds_check_mode: how out-of-range ids, invalid bags (a negative
            length, or past ``C``) and non-finite weights are reported; all of
            them contribute zero (see ``BoundsCheckMode``).
        implementation: ``None`` (per lowering platform: the C++ kernel on CPU,
            Pallas on GPUs, XLA elsewhere), ``"xla"``, ``"pallas"``, ``"cpu"`` or
            ``"mosaic_gpu"``
            (``jaxrec.ops.dispatch``).

    Returns:
        ``[B, D]`` float32.

    Example:
        >>> t = jnp.arange(8.0).reshape(4, 2)
        >>> pooled_lookup(t, jnp.array([1, 3]), jnp.array([2]), pooling=PoolingType.MEAN).tolist()
        [[4.0, 5.0]]
    """
    values = narrow_ids(values)  # id words -> int32 rows; wide ids out of range
    b, c = lengths.shape[0], values.shape[0]
    seg = segment_ids_from_lengths(lengths, c)  # invalid bags: b, like padding
    report_bags(~valid_bags(lengths, (c,), b), bounds_check_mode, "pooled_lookup", None)
    if weights is not None:
        bad = ~jnp.isfinite(weights) & (seg < b)
        report_weights(bad, bounds_check_mode, "pooled_lookup")
        weights = finite_weights(weights)
    valid = check_ids(values, seg < b, table.shape[0], bounds_check_mode, "pooled_lookup")
    rows = jnp.where(valid, values, 0)
    seg = jnp.where(valid, seg, b)
    out = embedding_bag(table, rows, seg, b, weights, implementation=implementation)
    if PoolingType(pooling) is PoolingType.MEAN:
        out = out / jnp.maximum(lengths, 1).astype(jnp.float32)[:, None]
    elif PoolingType(pooling) is not PoolingType.SUM:
        raise ValueError(f"pooling must be SUM or MEAN, got {pooling}")
    return out


def sequence_lookup(
    table: jax.Array,
    values: jax.Array,
    lengths: jax.Array,
    *,
    bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
    implementation: Implementation = None,
) -> jax.Array:
    """``torch.nn.Embedding`` over a jagged buffer: ``[C, D]``, padding rows zero.

    Rows of invalid bags (a negative length, or past ``C``) are zero too.
    ``implementation``: ``None``, ``"xla"``, ``"pallas"``, ``"cpu"`` or
    ``"mosaic_gpu"`` (no C++
    kernel gathers: ``"cpu"`` runs XLA), as in :func:`pooled_lookup`.
    """
    values = narrow_ids(values)  # id words -> int32 rows; wide ids out of range
    b, c = lengths.shape[0], values.shape[0]
    report_bags(~valid_bags(lengths, (c,), b), bounds_check_mode, "sequence_lookup", None)
    valid = segment_ids_from_lengths(lengths, c) < b
    valid = check_ids(values, valid, table.shape[0], bounds_check_mode, "sequence_lookup")
    return embedding_gather(
        table, jnp.where(valid, values, 0), valid, implementation=implementation
    )
