"""Which bags of a ragged buffer are usable, decided on device (works under ``jit``).

Host builders reject negative lengths and keys that overflow their capacity,
but arrays built on device are never pulled to the host. Every lookup path
(XLA, C++, Pallas) applies one rule to them instead:

* a bag's ids start where the previous bags of its key end, counting only
  non-negative lengths;
* a bag with a negative length, or whose ids run past its key's capacity,
  is invalid: it contributes zero (its ids are neither read nor trained).

Once a bag runs past the capacity every later non-empty bag of the key does
too, so setting invalid bags' lengths to zero (:func:`checked_lengths`) moves
no valid bag: the result is a layout every kernel handles as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def valid_bags(lengths: jax.Array, capacities: Sequence[int], stride: int) -> jax.Array:
    """``[F, B]`` bool: bag ``b`` of key ``k`` follows the rule above.

    Args:
        lengths: ``[F * B]`` key-major bag lengths, any integer dtype (compared
            in its own width).
        capacities: ``F`` static capacities (each below ``2**31 - 1``).
        stride: ``B``.
    """
    per_key = lengths.reshape(len(capacities), stride)
    caps = np.minimum(np.asarray(capacities, np.int64), 2**31 - 2).reshape(-1, 1)
    limit = np.minimum(caps, jnp.iinfo(per_key.dtype).max).astype(per_key.dtype)
    caps = caps.astype(np.int32)
    negative = per_key < 0
    fits = ~negative & (per_key <= limit)
    # A length above the capacity counts as capacity + 1: the running sum stays
    # below 2 * capacity + 2 (no int32 wrap) up to the first bag past the end.
    n = jnp.where(fits, per_key.astype(jnp.int32), jnp.where(negative, 0, caps + 1))

    # Running ends saturated at capacity + 1 (uint32: a sum of two never wraps):
    # they never fall and never wrap, so "past the capacity" sticks without a
    # running maximum.
    top = (caps + 1).astype(np.uint32)
    ends = jax.lax.associative_scan(
        lambda a, b: jnp.minimum(a + b, top), n.astype(jnp.uint32), axis=1
    )
    return ~negative & ((n == 0) | (ends <= caps.astype(np.uint32)))


def valid_bags_per_key(
    lengths: jax.Array, capacities: Sequence[int], strides: Sequence[int]
) -> jax.Array:
    """``[sum(strides)]`` bool: :func:`valid_bags` of a variable-batch (VBE) layout, where
    key ``k`` has ``strides[k]`` bags (``lengths``: ``[sum(strides)]``, key-major).

    Each key's bags are padded with empty bags (always valid, moving no end) to the
    largest stride, checked as :func:`valid_bags`, and read back.
    """
    strides = [int(s) for s in strides]
    top = max(strides, default=0)
    key_of = np.repeat(np.arange(len(strides)), strides)
    local = np.arange(sum(strides)) - np.repeat(np.cumsum([0, *strides[:-1]]), strides)
    flat = (key_of * top + local).astype(np.int32)
    padded = jnp.zeros((len(strides) * top,), lengths.dtype).at[flat].set(lengths)
    return valid_bags(padded, capacities, top).reshape(-1)[flat]


def checked_lengths(
    lengths: jax.Array, capacities: Sequence[int], stride: int | Sequence[int]
) -> jax.Array:
    """Lengths with every invalid bag's length set to zero (same dtype, same shape).

    ``stride``: ``B`` (``lengths`` ``[F * B]``), or one stride per key (a VBE layout,
    ``lengths`` ``[sum(stride)]``).
    """
    if isinstance(stride, int | np.integer):
        ok = valid_bags(lengths, capacities, int(stride)).reshape(-1)
    else:
        ok = valid_bags_per_key(lengths, capacities, stride)
    return jnp.where(ok, lengths, jnp.zeros((), lengths.dtype))


def finite_weights(weights: jax.Array | None) -> jax.Array | None:
    """Per-sample weights with NaN / inf replaced by 0 (their ids contribute zero)."""
    if weights is None:
        return None
    return jnp.where(jnp.isfinite(weights), weights, jnp.zeros((), weights.dtype))
