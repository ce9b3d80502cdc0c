"""Feature slots of a stacked buffer: which ids each slot reads, and where they land.

Every lookup path (XLA, Pallas, C++) and the sparse backward read ids through
these, so a slot means the same rows everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ..configs import PoolingType
from ..sparse import KeyedJaggedTensor
from ..sparse.bags import finite_weights
from .bounds import check_ids


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


class SlotPositions(NamedTuple):
    """Every id the slots read, in slot order (one entry per capacity position)."""

    ids: jax.Array  # [C] the KJT's ids
    weights: jax.Array | None  # [C] per-sample weights (non-finite zeroed), None if unweighted
    slot_of: np.ndarray  # [C] static: the slot each position belongs to
    bag: jax.Array  # [C] the position's bag (sample) within its key (VBE: of its B_k)
    valid: jax.Array  # [C] a real id of a valid bag (not padding)
    caps: list[int]  # per slot: its key's capacity


def slot_positions(features: KeyedJaggedTensor, slots: Sequence[FeatureSlot]) -> SlotPositions:
    """Ids, per-value slot/bag positions and masks for the slots, in slot order.

    Invalid bags (``jaxrec.sparse.bags``) are masked like padding; non-finite
    weights are zeroed, so their ids contribute zero.
    """
    keys = features.keys()
    check_keys(features, slots)
    f = len(keys)
    bag0 = np.asarray(features.bag_offsets(), np.int32)  # k * B without VBE
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
    valid = seg_k < bag0[-1]
    bag = seg_k - bag0[key_of]
    return SlotPositions(ids, w, slot_of, bag, valid, caps)


class KeyedSlot(Protocol):
    """A slot that names the key it reads (``FeatureSlot``, or a sharded layout's slot)."""

    @property
    def key(self) -> str: ...


def slot_bag_starts(features: KeyedJaggedTensor, slots: Sequence[KeyedSlot]) -> np.ndarray:
    """``[S + 1]`` static first row of each slot's bags in a VBE lookup's output
    ``[sum_j B_j, D]`` (slot-major: slot ``j`` holds its key's ``B_j`` bags)."""
    keys, spk = features.keys(), features.stride_per_key()
    return np.cumsum([0] + [spk[keys.index(sl.key)] for sl in slots]).astype(np.int32)


def vbe_mean_scale(features: KeyedJaggedTensor, slots: Sequence[FeatureSlot]) -> jax.Array | None:
    """:func:`mean_scale` of a VBE lookup: ``[sum_j B_j]`` float32, slot-major."""
    is_mean = [PoolingType(sl.pooling) is PoolingType.MEAN for sl in slots]
    if not any(is_mean):
        return None
    keys, bag0 = features.keys(), features.bag_offsets()
    idx = np.concatenate(
        [np.arange(bag0[keys.index(sl.key)], bag0[keys.index(sl.key) + 1]) for sl in slots]
    ).astype(np.int32)
    mean = np.repeat(np.asarray(is_mean), np.diff(slot_bag_starts(features, slots)))
    lengths = jnp.take(features.lengths(), idx)
    return jnp.where(mean, 1.0 / jnp.maximum(lengths, 1).astype(jnp.float32), 1.0)


def check_keys(features: KeyedJaggedTensor, slots: Sequence[FeatureSlot]) -> None:
    keys = features.keys()
    missing = sorted({s.key for s in slots} - set(keys))
    if missing:
        raise ValueError(f"features lack keys {missing} needed by the lookup; got keys {keys}")


def rows_and_mask(ids, valid, slot_of, slots, bounds_check_mode, where):
    """``(rows, valid)``: stacked-buffer rows of the ids (0 where invalid), bounds-checked."""
    offsets = np.asarray([s.row_offset for s in slots], np.int32)[slot_of]
    nums = np.asarray([s.num_embeddings for s in slots], np.int32)[slot_of]
    valid = check_ids(ids, valid, nums, bounds_check_mode, where)
    rows = jnp.where(valid, ids.astype(jnp.int32) + offsets, 0)
    return rows, valid


def mean_scale(features: KeyedJaggedTensor, slots: Sequence[FeatureSlot]) -> jax.Array | None:
    """``[B, S]`` float32 factors of MEAN pooling, None when no slot is MEAN.

    Bag ``b`` of a MEAN slot gets ``1 / max(length, 1)`` (its key's length for
    that bag: an empty or invalid bag divides by 1), a SUM slot 1. The pooled
    lookups multiply their sums by it and the sparse backward each id's
    gradient, so every path averages alike.
    """
    is_mean = np.asarray([PoolingType(sl.pooling) is PoolingType.MEAN for sl in slots])
    if not is_mean.any():
        return None
    features.require_uniform_stride("mean_scale (use vbe_mean_scale)")
    keys = features.keys()
    lengths = features.lengths().reshape(len(keys), features.stride())
    per_slot = lengths[np.asarray([keys.index(sl.key) for sl in slots])].T  # [B, S]
    return jnp.where(is_mean, 1.0 / jnp.maximum(per_slot, 1).astype(jnp.float32), 1.0)
