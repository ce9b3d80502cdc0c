"""Device-side reports of invalid ragged layouts and non-finite per-sample weights.

What such inputs contribute is fixed on every path (``jaxrec.sparse.bags``:
invalid bags and non-finite weights contribute zero); these functions only
report them through the lookup's ``bounds_check_mode``, as out-of-range ids
are: ``WARNING`` logs one line per call with the count and the first key,
``FATAL`` fails, ``IGNORE`` and ``NONE`` say nothing. Each check costs a
reduction to a scalar and a callback that runs only when something is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..sparse import KeyedJaggedTensor
from ..sparse.bags import valid_bags, valid_bags_per_key
from ..xla.bounds import BoundsCheckMode
from ..xla.layout import report_bad_bags, report_bad_weights


def report_layout(
    features: KeyedJaggedTensor,
    keys: Sequence[str],
    mode: BoundsCheckMode,
    where: str,
    *,
    weighted: bool = False,
) -> None:
    """Reports the invalid bags (and, if ``weighted``, non-finite weights) of ``keys``."""
    mode = BoundsCheckMode(mode)
    if mode in (BoundsCheckMode.NONE, BoundsCheckMode.IGNORE):
        return
    keys = list(dict.fromkeys(keys))
    all_keys = features.keys()
    idx = np.asarray([all_keys.index(k) for k in keys], np.int32)
    caps, b = features.capacity_per_key(), features.stride()
    lengths = features.lengths()
    if features.variable_stride_per_key():  # [F, max B_k], padded with empty valid bags
        spk = features.stride_per_key()
        b = max(spk, default=0)
        bag0 = np.asarray(features.bag_offsets()[:-1])
        key_of = np.repeat(np.arange(len(spk)), spk)
        at = key_of * b + np.arange(len(key_of)) - bag0[key_of]
        flat = valid_bags_per_key(lengths, caps, spk)
        ok = jnp.ones((len(spk) * b,), bool).at[at].set(flat).reshape(len(spk), b)
        lengths = jnp.zeros((len(spk) * b,), lengths.dtype).at[at].set(lengths)
    else:
        ok = valid_bags(lengths, caps, b)
    report_bags(~ok[idx], mode, where, keys)
    if weighted:
        # Valid bags are packed at the front of their key's slot, so the ids in
        # use are the first sum(valid lengths) of each read slot: one
        # elementwise pass (no per-id segment ids, no gathers); the first bad
        # position is mapped to its key on the host, in the message.
        f = len(all_keys)
        used = jnp.sum(jnp.where(ok, lengths.reshape(f, b), 0).astype(jnp.int32), 1)
        starts = features.capacity_offsets()
        end = jnp.concatenate(
            [
                jnp.broadcast_to(starts[k] + used[k] if k in idx else starts[k], (caps[k],))
                for k in range(f)
            ]
        )
        bad = ~jnp.isfinite(features.weights()) & (jax.lax.iota(jnp.int32, starts[-1]) < end)
        report_weights(bad, mode, where, all_keys, starts)


def report_bags(
    bad: jax.Array, mode: BoundsCheckMode, where: str, keys: Sequence[str] | None
) -> None:
    """``bad``: ``[K, B]`` invalid bags of ``K`` keys (``keys=None``: one unnamed key)."""
    per_key = jnp.sum(bad, axis=1, dtype=jnp.int32)
    first = jnp.argmax(per_key > 0) if keys else jnp.argmax(bad[0]) if bad.size else jnp.asarray(0)
    report_bad_bags(jnp.sum(per_key), first, mode, where, keys)


def report_weights(
    bad: jax.Array,
    mode: BoundsCheckMode,
    where: str,
    keys: Sequence[str] | None = None,
    starts: Sequence[int] | None = None,
) -> None:
    """``bad``: ``[C]`` non-finite weights of valid ids; key ``keys[k]`` owns
    positions ``[starts[k], starts[k + 1])`` (``keys=None``: one unnamed key)."""
    count = jnp.sum(bad, dtype=jnp.int32)
    # argmax over every weight costs more than the check itself: only when needed.
    first = jnp.int32(0)
    if bad.size:
        first = jax.lax.cond(count > 0, lambda: jnp.argmax(bad).astype(jnp.int32), lambda: first)
    report_bad_weights(count, first, mode, where, keys, starts)
