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
from .bounds import BoundsCheckMode, report_check


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
    ok = valid_bags(features.lengths(), features.capacity_per_key(), features.stride())
    report_bags(~ok[idx], mode, where, keys)
    if weighted:
        f, b = len(all_keys), features.stride()
        key_of = np.repeat(np.arange(f, dtype=np.int32), features.capacity_per_key())
        position = np.full(f, -1, np.int32)  # key index -> its position in ``keys``
        position[idx] = np.arange(len(keys), dtype=np.int32)
        w = features.weights()
        bad = ~jnp.isfinite(w) & (features.segment_ids() < f * b) & (position[key_of] >= 0)
        report_weights(bad, jnp.asarray(position[key_of]), mode, where, keys)


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
    bad: jax.Array, key_of: jax.Array | None, mode: BoundsCheckMode, where: str, keys=None
) -> None:
    """``bad``: ``[C]`` non-finite weights of valid ids; ``key_of[c]`` indexes ``keys``."""
    first = jnp.argmax(bad) if bad.size else 0
    example = key_of[first] if key_of is not None and bad.size else first

    def message(count: int, example: int) -> str:
        at = f"key {keys[example]!r}" if keys else f"position {example}"
        return (
            f"{count} per-sample weights of {where} are NaN or infinite (the first in {at}); "
            "their ids contribute zero: fix the weights where the batch is built"
        )

    report_check(jnp.sum(bad, dtype=jnp.int32), example, mode, f"weights of {where}", message)
