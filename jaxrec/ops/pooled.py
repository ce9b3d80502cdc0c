"""Pooled (embedding-bag) lookup: gather rows and sum them per bag."""

from __future__ import annotations

import jax

from ..xla.lookup import embedding_bag_xla, embedding_gather_xla
from .dispatch import Implementation, dispatch


def embedding_bag(
    weights: jax.Array,
    rows: jax.Array,
    segment_ids: jax.Array,
    num_segments: int,
    per_value_scale: jax.Array | None = None,
    *,
    implementation: Implementation = None,
) -> jax.Array:
    """Sums ``weights[rows]`` per segment, accumulating in float32.

    This is the kernel-level op behind every pooled lookup: callers have
    already offset rows into a stacked buffer and masked padding.

    Args:
        weights: ``[R, D]`` table (or stacked tables), any float dtype.
        rows: ``[C]`` integer rows in ``[0, R)``.
        segment_ids: ``[C]`` output segment of each row; ids ``>= num_segments``
            (padding, dropped ids) contribute nothing.
        num_segments: static number of output rows ``S``.
        per_value_scale: optional ``[C]`` float multiplier (per-sample weights).
        implementation: ``None`` (per lowering platform: the C++ kernel on CPU,
            Pallas on GPUs, XLA elsewhere), ``"xla"``, ``"pallas"``, ``"cpu"`` or
            ``"mosaic_gpu"``
            (``jaxrec.ops.dispatch``).

    Returns:
        ``[S, D]`` float32 sums.
    """
    return dispatch(
        "embedding_bag",
        implementation,
        embedding_bag_xla,
        weights,
        rows,
        segment_ids,
        num_segments,
        per_value_scale,
    )


def embedding_gather(
    weights: jax.Array, rows: jax.Array, valid: jax.Array, *, implementation: Implementation = None
) -> jax.Array:
    """``[C, D]`` rows ``weights[rows]`` with invalid positions zeroed (sequence lookup).

    ``implementation``: ``None``, ``"xla"``, ``"pallas"``, ``"cpu"`` or
    ``"mosaic_gpu"`` as in
    :func:`embedding_bag` (no C++ kernel gathers: ``"cpu"`` runs XLA).
    """
    return dispatch("embedding_gather", implementation, embedding_gather_xla, weights, rows, valid)
