"""Table-batched ("TBE") lookups: many features over one stacked weight buffer.

Tables that share ``(embedding_dim, dtype)`` are stacked row-wise in one
``[R, D]`` buffer; each feature slot names the KJT key it reads and the static
row offset of its table. One gather (one kernel) then serves every slot.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..configs import PoolingType
from ..sparse import KeyedJaggedTensor
from ..sparse.bags import finite_weights
from .bounds import BoundsCheckMode, check_ids
from .dispatch import try_cpu
from .layout import report_layout
from .pooled import embedding_bag, embedding_gather


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureSlot:
    """One (feature, table) lookup inside a stacked buffer.

    Attributes:
        key: the KeyedJaggedTensor key read.
        row_offset: first row of the table in the stacked buffer.
        num_embeddings: the table's rows; ids must lie in ``[0, num_embeddings)``.
        pooling: SUM or MEAN for pooled lookups (ignored by sequence lookups).
    """

    key: str
    row_offset: int
    num_embeddings: int
    pooling: PoolingType = PoolingType.SUM


def _slot_positions(features: KeyedJaggedTensor, slots: Sequence[FeatureSlot]):
    """Ids, per-value slot/bag positions and masks for the slots, in slot order.

    Invalid bags (``jaxrec.sparse.bags``) are masked like padding; non-finite
    weights are zeroed, so their ids contribute zero.
    """
    keys = features.keys()
    _check_keys(features, slots)
    f, b = len(keys), features.stride()
    starts = features.capacity_offsets()
    key_idx = [keys.index(s.key) for s in slots]
    caps = [features.capacity_per_key()[k] for k in key_idx]
    seg_all = features.segment_ids()
    if key_idx == list(range(f)):  # slots read every key in order: no copies
        ids, seg_k, w = features.values(), seg_all, finite_weights(features.weights_or_none())
    else:

        def take(x):
            return jnp.concatenate([x[starts[k] : starts[k + 1]] for k in key_idx])

        ids, seg_k = take(features.values()), take(seg_all)
        w = finite_weights(None if features.weights_or_none() is None else take(features.weights()))
    slot_of = np.repeat(np.arange(len(slots), dtype=np.int32), caps)
    key_of = np.repeat(np.asarray(key_idx, np.int32), caps)
    valid = seg_k < f * b
    bag = seg_k - key_of * b
    return ids, w, slot_of, bag, valid, caps


def _check_keys(features: KeyedJaggedTensor, slots: Sequence[FeatureSlot]) -> None:
    keys = features.keys()
    missing = sorted({s.key for s in slots} - set(keys))
    if missing:
        raise ValueError(f"features lack keys {missing} needed by the lookup; got keys {keys}")


def _rows_and_mask(ids, valid, slot_of, slots, bounds_check_mode, where):
    offsets = np.asarray([s.row_offset for s in slots], np.int32)[slot_of]
    nums = np.asarray([s.num_embeddings for s in slots], np.int32)[slot_of]
    valid = check_ids(ids, valid, nums, bounds_check_mode, where)
    rows = jnp.where(valid, ids.astype(jnp.int32) + offsets, 0)
    return rows, valid


def grouped_pooled_lookup(
    weights: jax.Array,
    features: KeyedJaggedTensor,
    slots: Sequence[FeatureSlot],
    *,
    is_weighted: bool = False,
    bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
    implementation: str | None = None,
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
        implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"cpu"`` (one C++ call
            reading the KJT directly; see ``jaxrec.cpu``).

    Returns:
        ``[B, S, D]`` float32; empty bags give zeros, and so do invalid bags (a
        negative length, or past the key's capacity: ``jaxrec.sparse.bags``).
        An id with a NaN or infinite weight contributes zero. ``B`` may be 0.
    """
    if not slots:
        raise ValueError("grouped_pooled_lookup needs at least one slot")
    if is_weighted and features.weights_or_none() is None:
        raise ValueError(
            "is_weighted=True but the features carry no weights; build the KJT with weights="
        )
    where = f"pooled lookup of {[sl.key for sl in slots]}"
    _check_keys(features, slots)
    report_layout(
        features, [sl.key for sl in slots], bounds_check_mode, where, weighted=is_weighted
    )
    xla_fn = functools.partial(
        _grouped_pooled_xla,
        slots=tuple(slots),
        is_weighted=is_weighted,
        bounds_check_mode=bounds_check_mode,
        where=where,
        implementation=implementation,
    )
    return try_cpu(
        "grouped_pooled_lookup",
        implementation,
        lambda: xla_fn(weights, features),
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
    ids, w, slot_of, bag, valid, _ = _slot_positions(features, slots)
    rows, valid = _rows_and_mask(ids, valid, slot_of, slots, bounds_check_mode, where)
    seg = jnp.where(valid, bag * s + slot_of, b * s)  # output order [B, S]
    pooled = embedding_bag(
        weights, rows, seg, b * s, w if is_weighted else None, implementation=implementation
    ).reshape(b, s, weights.shape[1])  # not -1: B may be 0
    means = [i for i, sl in enumerate(slots) if PoolingType(sl.pooling) is PoolingType.MEAN]
    if means:
        keys = features.keys()
        lengths = features.lengths().reshape(len(keys), b)
        per_slot = lengths[np.asarray([keys.index(sl.key) for sl in slots])].T  # [B, S]
        is_mean = np.zeros(s, bool)
        is_mean[means] = True
        scale = jnp.where(is_mean, 1.0 / jnp.maximum(per_slot, 1).astype(jnp.float32), 1.0)
        pooled = pooled * scale[:, :, None]
    return pooled


def grouped_sequence_lookup(
    weights: jax.Array,
    features: KeyedJaggedTensor,
    slots: Sequence[FeatureSlot],
    *,
    bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
    implementation: str | None = None,
) -> list[jax.Array]:
    """Unpooled lookup: one ``[capacity_k, D]`` array per slot, padding rows zero.

    Rows of invalid bags (``jaxrec.sparse.bags``) are zero too; they are
    reported by ``bounds_check_mode`` as in :func:`grouped_pooled_lookup`.
    """
    if not slots:
        raise ValueError("grouped_sequence_lookup needs at least one slot")
    where = f"sequence lookup of {[sl.key for sl in slots]}"
    _check_keys(features, slots)
    report_layout(features, [sl.key for sl in slots], bounds_check_mode, where)
    ids, _, slot_of, _, valid, caps = _slot_positions(features, slots)
    rows, valid = _rows_and_mask(ids, valid, slot_of, slots, bounds_check_mode, where)
    emb = embedding_gather(weights, rows, valid, implementation=implementation)
    return jnp.split(emb, np.cumsum(caps)[:-1].tolist())
