"""Sparse backward: output gradients -> per-id row gradients -> de-duplicated rows.

The gradient of a lookup with respect to its table touches only the rows the
batch read. These functions map the gradient of the pooled (or sequence)
output back to one gradient row per id, then sum duplicates so that each
touched row gets exactly one update (FBGEMM's EXACT semantics). Nothing here
is table-sized.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ..optim.base import apply_rows
from ..sparse import KeyedJaggedTensor
from .bounds import BoundsCheckMode
from .slots import (
    FeatureSlot,
    mean_scale,
    rows_and_mask,
    slot_bag_starts,
    slot_positions,
    vbe_mean_scale,
)


def pooled_row_grads(
    out_grad: jax.Array,
    features: KeyedJaggedTensor,
    slots: Sequence[FeatureSlot],
    *,
    is_weighted: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-id gradients of a grouped pooled lookup.

    Args:
        out_grad: ``[B, S, D]`` gradient of the loss w.r.t. the pooled output
            (VBE: ``[sum_j B_j, D]``, as ``grouped_pooled_lookup`` returns).
        features: the batch that was looked up.
        slots: the ``S`` slots of the lookup.
        is_weighted: the lookup multiplied rows by per-sample weights.

    Returns:
        ``rows [C]`` (stacked-buffer rows), ``grads [C, D]`` float32 and
        ``valid [C]`` (False for padding and out-of-range ids, whose grads are 0).
        Each id's gradient is its bag's output gradient, times its weight,
        divided by the bag length for MEAN.
    """
    rows, seg, scale, valid = pooled_grad_sources(features, slots, is_weighted=is_weighted)
    flat = out_grad.astype(jnp.float32).reshape(-1, out_grad.shape[-1])
    return rows, source_grads(flat, seg, scale, valid), valid


def pooled_grad_sources(
    features: KeyedJaggedTensor, slots: Sequence[FeatureSlot], *, is_weighted: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Where each id's gradient comes from, without forming it.

    Returns ``rows [C]``, ``seg [C]`` (the id's row of the output gradient
    flattened to ``[B * S, D]``; VBE: of ``[sum_j B_j, D]``), ``scale [C]`` float32
    (weight, 1/length for MEAN, 0 where invalid) and ``valid [C]``: id ``c``'s
    gradient is ``flat[seg[c]] * scale[c]``. The fused backward kernel reads this
    directly.
    """
    b, s = features.stride(), len(slots)
    ids, w, slot_of, bag, valid, _ = slot_positions(features, slots)
    rows, valid = rows_and_mask(ids, valid, slot_of, slots, BoundsCheckMode.IGNORE, "")
    scale = jnp.where(valid, 1.0, 0.0)
    if is_weighted:
        if w is None:
            raise ValueError("is_weighted=True needs features with weights; got weights=None")
        scale = scale * w.astype(jnp.float32)
    if features.variable_stride_per_key():
        starts = slot_bag_starts(features, slots)
        seg = jnp.where(valid, starts[slot_of] + bag, 0)
        per_bag = vbe_mean_scale(features, slots)  # [sum_j B_j]
        if per_bag is not None:
            scale = scale * per_bag[seg]
        return rows, seg, scale, valid
    per_bag = mean_scale(features, slots)  # [B, S]
    if per_bag is not None:
        scale = scale * per_bag[jnp.clip(bag, 0, b - 1), slot_of]
    seg = jnp.where(valid, bag * s + slot_of, 0)
    return rows, seg, scale, valid


def sequence_row_grads(
    out_grads: Sequence[jax.Array],
    features: KeyedJaggedTensor,
    slots: Sequence[FeatureSlot],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-id gradients of a grouped sequence lookup (``out_grads[i]``: ``[cap_i, D]``)."""
    rows, seg, scale, valid = sequence_grad_sources(features, slots)
    flat = jnp.concatenate([g.astype(jnp.float32) for g in out_grads])
    return rows, source_grads(flat, seg, scale, valid), valid


def sequence_grad_sources(
    features: KeyedJaggedTensor, slots: Sequence[FeatureSlot]
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`pooled_grad_sources` for a sequence lookup (output rows concatenated by slot)."""
    ids, _, slot_of, _, valid, _ = slot_positions(features, slots)
    rows, valid = rows_and_mask(ids, valid, slot_of, slots, BoundsCheckMode.IGNORE, "")
    seg = jnp.arange(ids.shape[0], dtype=jnp.int32)
    return rows, seg, jnp.where(valid, 1.0, 0.0), valid


def source_grads(flat: jax.Array, seg: jax.Array, scale: jax.Array, valid: jax.Array) -> jax.Array:
    """Per-id gradients ``[C, D]`` float32 from :func:`pooled_grad_sources`' description."""
    grads = jnp.take(flat.astype(jnp.float32), seg, axis=0) * scale[:, None]
    return jnp.where(valid[:, None], grads, 0.0)


def dedup_rows(
    rows: jax.Array, grads: jax.Array, valid: jax.Array, num_rows: int, size: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Sums gradients of repeated rows: one entry per touched row.

    Args:
        rows: ``[C]`` row ids.
        grads: ``[C, D]`` per-occurrence gradients.
        valid: ``[C]``; invalid entries are ignored.
        num_rows: rows of the table; the fill id is ``num_rows`` (out of range on
            the high side, so a scatter with ``mode="drop"`` skips it and it can
            never alias a real row).
        size: static number of unique slots (default ``C``, always enough).

    Returns:
        ``unique [size]`` sorted row ids padded with ``num_rows``, and
        ``summed [size, D]`` float32 gradients (zero for padding).
    """
    size = rows.shape[0] if size is None else size
    keyed = jnp.where(valid, rows, num_rows)
    unique, inverse = jnp.unique(keyed, size=size, fill_value=num_rows, return_inverse=True)
    summed = jax.ops.segment_sum(
        jnp.where(valid[:, None], grads, 0.0), inverse.reshape(-1), num_segments=size
    )
    return unique, summed


def backward_update_xla(optimizer, table, state, out_grad, seg, scale, rows, valid):
    """A lookup's backward and one optimizer step in XLA: per-id gradients
    (:func:`source_grads`), :func:`dedup_rows`, then ``jaxrec.optim.apply_rows``."""
    unique, summed = dedup_rows(
        rows, source_grads(out_grad, seg, scale, valid), valid, table.shape[0]
    )
    return apply_rows(optimizer, table, state, unique, summed)
