"""Table-batched ("TBE") lookups: many features over one stacked weight buffer.

Tables that share ``(embedding_dim, dtype)`` are stacked row-wise in one
``[R, D]`` buffer; each feature slot names the KJT key it reads and the static
row offset of its table. One gather (one kernel) then serves every slot.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..sparse import KeyedJaggedTensor
from ..xla.bounds import BoundsCheckMode
from ..xla.slots import (
    FeatureSlot,
    check_keys,
    mean_scale,
    rows_and_mask,
    slot_bag_starts,
    slot_positions,
    vbe_mean_scale,
)
from .dispatch import Implementation, try_cpu
from .layout import report_layout
from .pooled import embedding_bag, embedding_gather


def grouped_pooled_lookup(
    weights: jax.Array,
    features: KeyedJaggedTensor,
    slots: Sequence[FeatureSlot],
    *,
    is_weighted: bool = False,
    bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
    implementation: Implementation = None,
) -> jax.Array:
    """Pooled lookup of every slot over one stacked buffer.

    Args:
        weights: ``[R, D]`` stacked tables.
        features: the batch; ``stride()`` is ``B``.
        slots: ``S`` feature slots.
        is_weighted: multiply each id's row by its per-sample weight
            (MEAN then divides the weighted sum by the bag length, as FBGEMM).
        bounds_check_mode: how out-of-range ids, invalid bags and (if weighted)
            non-finite weights are reported (see ``BoundsCheckMode``).
        implementation: ``None`` (per lowering platform: the C++ kernel on CPU,
            Pallas on GPUs, XLA elsewhere), ``"xla"``, ``"pallas"``, ``"cpu"`` or
            ``"mosaic_gpu"``
            (one C++ call reading the KJT directly; see ``jaxrec.cpu``).

    Returns:
        ``[B, S, D]`` float32; empty bags give zeros, and so do invalid bags (a
        negative length, or past the key's capacity: ``jaxrec.sparse.bags``).
        An id with a NaN or infinite weight contributes zero. ``B`` may be 0.
        With a variable batch per key (VBE), ``[sum_j B_j, D]``: slot ``j``'s
        ``B_j`` bags (its key's stride) at rows ``slot_bag_starts(...)[j]`` on,
        not expanded (the caller expands with the inverse indices).
    """
    if not slots:
        raise ValueError("grouped_pooled_lookup needs at least one slot")
    features = features.narrow_ids()  # id words -> int32 rows; wide ids out of range
    if is_weighted and features.weights_or_none() is None:
        raise ValueError(
            "is_weighted=True but the features carry no weights; build the KJT with weights="
        )
    where = f"pooled lookup of {[sl.key for sl in slots]}"
    check_keys(features, slots)
    xla_fn = functools.partial(
        _grouped_pooled_xla,
        slots=tuple(slots),
        is_weighted=is_weighted,
        bounds_check_mode=bounds_check_mode,
        where=where,
        implementation=implementation,
    )

    def xla_path():
        report_layout(
            features, [sl.key for sl in slots], bounds_check_mode, where, weighted=is_weighted
        )
        return xla_fn(weights, features)

    if features.variable_stride_per_key():  # the C++ kernel reads [F * B] lengths
        return xla_path()

    # The C++ kernel checks the layout in its own walk of the lengths.
    return try_cpu(
        "grouped_pooled_lookup",
        implementation,
        xla_path,
        weights,
        features,
        slots,
        is_weighted=is_weighted,
        bounds_check_mode=bounds_check_mode,
        where=where,
        xla_fn=xla_fn,
    )


def _grouped_pooled_xla(
    weights, features, *, slots, is_weighted, bounds_check_mode, where, implementation
):
    b, s = features.stride(), len(slots)
    ids, w, slot_of, bag, valid, _ = slot_positions(features, slots)
    rows, valid = rows_and_mask(ids, valid, slot_of, slots, bounds_check_mode, where)
    if features.variable_stride_per_key():  # output [sum_j B_j, D], slot-major
        starts = slot_bag_starts(features, slots)
        seg = jnp.where(valid, starts[slot_of] + bag, starts[-1])
        pooled = embedding_bag(
            weights,
            rows,
            seg,
            int(starts[-1]),
            w if is_weighted else None,
            implementation=implementation,
        )
        scale = vbe_mean_scale(features, slots)
        return pooled if scale is None else pooled * scale[:, None]
    seg = jnp.where(valid, bag * s + slot_of, b * s)  # output order [B, S]
    pooled = embedding_bag(
        weights, rows, seg, b * s, w if is_weighted else None, implementation=implementation
    ).reshape(b, s, weights.shape[1])  # not -1: B may be 0
    scale = mean_scale(features, slots)
    return pooled if scale is None else pooled * scale[:, :, None]


def grouped_sequence_lookup(
    weights: jax.Array,
    features: KeyedJaggedTensor,
    slots: Sequence[FeatureSlot],
    *,
    bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
    implementation: Implementation = None,
) -> list[jax.Array]:
    """Unpooled lookup: one ``[capacity_k, D]`` array per slot, padding rows zero.

    Rows of invalid bags (``jaxrec.sparse.bags``) are zero too; they are
    reported by ``bounds_check_mode`` as in :func:`grouped_pooled_lookup`.
    ``implementation``: ``None``, ``"xla"``, ``"pallas"``, ``"cpu"`` or
    ``"mosaic_gpu"`` (no C++
    kernel gathers: ``"cpu"`` runs XLA), as in :func:`grouped_pooled_lookup`.
    """
    if not slots:
        raise ValueError("grouped_sequence_lookup needs at least one slot")
    features = features.narrow_ids()  # id words -> int32 rows; wide ids out of range
    features.require_uniform_stride("a sequence lookup (EmbeddingCollection)")
    where = f"sequence lookup of {[sl.key for sl in slots]}"
    check_keys(features, slots)
    report_layout(features, [sl.key for sl in slots], bounds_check_mode, where)
    ids, _, slot_of, _, valid, caps = slot_positions(features, slots)
    rows, valid = rows_and_mask(ids, valid, slot_of, slots, bounds_check_mode, where)
    emb = embedding_gather(weights, rows, valid, implementation=implementation)
    return jnp.split(emb, np.cumsum(caps)[:-1].tolist())
