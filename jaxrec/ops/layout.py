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
from ..sparse.bags import valid_bags
from ..xla.bounds import BoundsCheckMode, report_check


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
    ok = valid_bags(features.lengths(), caps, b)
    report_bags(~ok[idx], mode, where, keys)
    if weighted:
        # Valid bags are packed at the front of their key's slot, so the ids in
        # use are the first sum(valid lengths) of each read slot: one
        # elementwise pass (no per-id segment ids, no gathers); the first bad
        # position is mapped to its key on the host, in the message.
        f = len(all_keys)
        used = jnp.sum(jnp.where(ok, features.lengths().reshape(f, b), 0).astype(jnp.int32), 1)
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
    first = jnp.argmax(per_key > 0) if keys else jnp.argmax(bad[0]) if bad.size else 0

    def message(count: int, example: int) -> str:
        at = f"key {keys[example]!r}" if keys else f"bag {example}"
        return (
            f"{count} bags of {where} have a negative length or run past their key's "
            f"capacity (the first in {at}); lengths must be >= 0 and each key's lengths "
            "must sum to at most its capacity: fix them or raise capacities="
        )

    report_check(jnp.sum(per_key), first, mode, f"bag lengths of {where}", message)


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

    def message(count: int, example: int) -> str:
        if keys:
            at = f"key {keys[int(np.searchsorted(starts, example, side='right')) - 1]!r}"
        else:
            at = f"position {example}"
        return (
            f"{count} per-sample weights of {where} are NaN or infinite (the first in {at}); "
            "their ids contribute zero: fix the weights where the batch is built"
        )

    report_check(count, first, mode, f"weights of {where}", message)
