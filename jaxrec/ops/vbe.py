"""Expanding a variable-batch (VBE) pooled lookup to the batch: one row gather."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..sparse import KeyedJaggedTensor
from ..xla.slots import FeatureSlot, slot_bag_starts


def expand_slots(
    pooled: jax.Array, features: KeyedJaggedTensor, slots: Sequence[FeatureSlot]
) -> jax.Array:
    """``[B, S * D]``: each sample's pooled row of every slot, from a VBE lookup.

    Args:
        pooled: ``[sum_j B_j, D]`` as ``grouped_pooled_lookup`` returns for a VBE
            batch (slot ``j``'s bags from ``slot_bag_starts(features, slots)[j]``).
        features: the VBE batch (its ``inverse_indices`` ``[F, B]``).
        slots: the ``S`` slots of the lookup.

    Returns:
        ``[B, S * D]`` (sample-major, slot ``j`` in columns ``[j * D, (j + 1) * D)``),
        the layout of a plain lookup's ``[B, S, D]`` output. Its gradient with
        respect to ``pooled`` sums the samples of each bag (a segment sum), so
        a backward through it runs on the ``B_k`` bags.
    """
    keys, inverse = features.inverse_indices()
    starts = slot_bag_starts(features, slots)[:-1]
    key_idx = np.asarray([keys.index(sl.key) for sl in slots], np.int32)
    rows = starts[None, :] + jnp.take(inverse, key_idx, axis=0).T  # [B, S]
    b, s = rows.shape
    return jnp.take(pooled, rows.reshape(-1), axis=0).reshape(b, s * pooled.shape[1])
