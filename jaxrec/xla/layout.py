"""Reports of invalid bag layouts and non-finite per-sample weights, however counted.

The XLA path counts them with ``jnp`` (``jaxrec.ops.layout``), the C++ lookup
in its own walk of the lengths; both report through these, so the messages
(and ``BoundsCheckMode`` handling) are one.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from .bounds import BoundsCheckMode, report_check


def report_bad_bags(
    count: jax.Array,
    first: jax.Array,
    mode: BoundsCheckMode,
    where: str,
    keys: Sequence[str] | None,
) -> None:
    """``count`` invalid bags, the first in key ``keys[first]`` (``keys=None``: bag ``first``)."""

    def message(count: int, example: int) -> str:
        at = f"key {keys[example]!r}" if keys else f"bag {example}"
        return (
            f"{count} bags of {where} have a negative length or run past their key's "
            f"capacity (the first in {at}); lengths must be >= 0 and each key's lengths "
            "must sum to at most its capacity: fix them or raise capacities="
        )

    report_check(count, first, mode, f"bag lengths of {where}", message)


def report_bad_weights(
    count: jax.Array,
    first: jax.Array,
    mode: BoundsCheckMode,
    where: str,
    keys: Sequence[str] | None = None,
    starts: Sequence[int] | None = None,
) -> None:
    """``count`` non-finite weights of valid ids, the first at position ``first``; key
    ``keys[k]`` owns positions ``[starts[k], starts[k + 1])`` (``keys=None``: one unnamed key)."""

    def message(count: int, example: int) -> str:
        if keys and starts is not None:
            at = f"key {keys[int(np.searchsorted(starts, example, side='right')) - 1]!r}"
        else:
            at = f"position {example}"
        return (
            f"{count} per-sample weights of {where} are NaN or infinite (the first in {at}); "
            "their ids contribute zero: fix the weights where the batch is built"
        )

    report_check(count, first, mode, f"weights of {where}", message)
