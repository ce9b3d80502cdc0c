"""Out-of-range id handling, with FBGEMM's ``BoundsCheckMode`` choices.

``WARNING`` (the default, as in FBGEMM) and ``IGNORE`` drop out-of-range ids:
they contribute zero to their bag (FBGEMM instead reads row 0). ``WARNING``
also logs how many ids were dropped and one example, via a host callback that
runs only when a bad id is present. ``FATAL`` raises at run time (a
``JaxRuntimeError`` whose message names the feature). ``NONE`` skips the check:
an out-of-range id then reads an arbitrary row (XLA clamps gather indices, and
in a stacked buffer that is a neighbouring table's row): use it only for ids
known to be valid. Ids are out of range when ``< 0`` or ``>= num_embeddings``.
"""

from __future__ import annotations

import enum
import logging

import jax
import jax.numpy as jnp

logger = logging.getLogger("jaxrec")


class BoundsCheckMode(enum.Enum):
    FATAL = "FATAL"
    WARNING = "WARNING"
    IGNORE = "IGNORE"
    NONE = "NONE"


def _report(mode: BoundsCheckMode, where: str):
    def callback(count, example):
        count, example = int(count), int(example)
        if count == 0:
            return
        msg = (
            f"{count} ids out of range in {where} (e.g. id {example}); ids must lie in "
            "[0, num_embeddings): hash or remap them before the lookup"
        )
        if mode is BoundsCheckMode.FATAL:
            raise ValueError(msg)
        logger.warning("%s; they were dropped (contribute zero)", msg)

    return callback


def check_ids(
    ids: jax.Array,
    valid: jax.Array,
    num_embeddings: jax.Array | int,
    mode: BoundsCheckMode,
    where: str,
) -> jax.Array:
    """Returns the ``valid`` mask with out-of-range ids removed (per ``mode``).

    Args:
        ids: ``[C]`` integer ids.
        valid: ``[C]`` bool, False for padding.
        num_embeddings: rows of the table each id indexes (scalar or ``[C]``).
        mode: what to do with out-of-range ids.
        where: names the lookup in messages.
    """
    mode = BoundsCheckMode(mode)
    if mode is BoundsCheckMode.NONE:
        return valid
    in_range = (ids >= 0) & (ids < num_embeddings)
    if mode is not BoundsCheckMode.IGNORE:
        bad = valid & ~in_range
        count = jnp.sum(bad, dtype=jnp.int32)
        example = ids[jnp.argmax(bad)] if ids.shape[0] else jnp.zeros((), ids.dtype)
        report_out_of_range(count, example, mode, where)
    return valid & in_range


def report_out_of_range(
    count: jax.Array, example: jax.Array, mode: BoundsCheckMode, where: str
) -> None:
    """WARNING logs and FATAL raises (at run time) when ``count > 0`` ids were out of range."""
    mode = BoundsCheckMode(mode)
    if mode in (BoundsCheckMode.NONE, BoundsCheckMode.IGNORE):
        return
    jax.lax.cond(
        count > 0,
        lambda: jax.debug.callback(_report(mode, where), count, example),
        lambda: None,
    )
