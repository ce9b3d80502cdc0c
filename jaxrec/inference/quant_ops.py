"""Lookups over quantized row buffers: dequantize inside the pooling.

The quantized counterpart of ``jaxrec.ops.embedding_bag`` and the grouped
(table-batched) lookups: rows are gathered as ``uint8`` TBE rows, only the
gathered rows are dequantized (``q * scale + bias`` in float32), then scaled
and segment-summed. No ``[R, D]`` float table ever exists.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import BoundsCheckMode, FeatureSlot
from ..ops.dispatch import Implementation, dispatch
from ..sparse import KeyedJaggedTensor
from ..xla.quantize import canonical_dtype, dequantize_rows
from ..xla.slots import mean_scale, rows_and_mask, slot_positions


def quant_embedding_bag(
    qweights: jax.Array,
    rows: jax.Array,
    segment_ids: jax.Array,
    num_segments: int,
    per_value_scale: jax.Array | None = None,
    *,
    dim: int,
    dtype: str,
    implementation: Implementation = None,
) -> jax.Array:
    """Sums dequantized ``qweights[rows]`` per segment, in float32.

    Args:
        qweights: ``[R, W]`` uint8 rows (``jaxrec.inference.quantize_rows``).
        rows: ``[C]`` int rows in ``[0, R)`` (out-of-range rows are clamped).
        segment_ids: ``[C]`` output segment per row; ``>= num_segments`` drops it.
        num_segments: static number of output rows ``S``.
        per_value_scale: optional ``[C]`` float multiplier.
        dim: the embedding dim ``D``.
        dtype: the rows' quantized type (``"int8"``, ``"int4"``, ``"fp16"``, ...).
        implementation: ``None`` (Pallas on GPUs for INT8/INT4, XLA elsewhere),
            ``"xla"``, ``"pallas"``, ``"cpu"`` or
            ``"mosaic_gpu"`` (no C++ kernel: runs XLA).

    Returns:
        ``[S, D]`` float32.
    """
    if qweights.dtype != jnp.uint8 or qweights.ndim != 2:
        raise TypeError(
            f"qweights must be [rows, bytes] uint8, got {qweights.shape=} {qweights.dtype=}"
        )
    return dispatch(
        "quant_embedding_bag",
        implementation,
        quant_embedding_bag_xla,
        qweights,
        rows,
        segment_ids,
        num_segments,
        per_value_scale,
        dim=dim,
        dtype=canonical_dtype(dtype),
    )


@functools.partial(jax.jit, static_argnames=("num_segments", "dim", "dtype"))
def quant_embedding_bag_xla(
    qweights, rows, segment_ids, num_segments, per_value_scale=None, *, dim, dtype
):
    packed = jnp.take(qweights, rows, axis=0, mode="clip")  # [C, W] uint8
    emb = dequantize_rows(packed, dim, dtype)  # [C, D] float32, gathered rows only
    if per_value_scale is not None:
        emb = emb * per_value_scale.astype(jnp.float32)[:, None]
    return jax.ops.segment_sum(emb, segment_ids, num_segments=num_segments)


def quant_grouped_pooled_lookup(
    qweights: jax.Array,
    features: KeyedJaggedTensor,
    slots: Sequence[FeatureSlot],
    *,
    dim: int,
    dtype: str,
    is_weighted: bool = False,
    bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
    implementation: Implementation = None,
) -> jax.Array:
    """``jaxrec.ops.grouped_pooled_lookup`` over a stacked quantized buffer: ``[B, S, D]``.

    ``implementation``: ``None``, ``"xla"``, ``"pallas"``, ``"cpu"`` or
    ``"mosaic_gpu"``, as in
    :func:`quant_embedding_bag`.
    """
    if not slots:
        raise ValueError("quant_grouped_pooled_lookup needs at least one slot")
    features = features.narrow_ids()  # id words -> int32 rows; wide ids out of range
    b, s = features.stride(), len(slots)
    ids, w, slot_of, bag, valid, _ = slot_positions(features, slots)
    if is_weighted and w is None:
        raise ValueError(
            "is_weighted=True but the features carry no weights; build the KJT with weights="
        )
    where = f"quantized pooled lookup of {[sl.key for sl in slots]}"
    rows, valid = rows_and_mask(ids, valid, slot_of, slots, bounds_check_mode, where)
    seg = jnp.where(valid, bag * s + slot_of, b * s)
    pooled = quant_embedding_bag(
        qweights,
        rows,
        seg,
        b * s,
        w if is_weighted else None,
        dim=dim,
        dtype=dtype,
        implementation=implementation,
    ).reshape(b, s, dim)
    scale = mean_scale(features, slots)
    return pooled if scale is None else pooled * scale[:, :, None]


def quant_grouped_sequence_lookup(
    qweights: jax.Array,
    features: KeyedJaggedTensor,
    slots: Sequence[FeatureSlot],
    *,
    dim: int,
    dtype: str,
    bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
) -> list[jax.Array]:
    """Unpooled lookup: one dequantized ``[capacity_k, D]`` float32 array per slot."""
    if not slots:
        raise ValueError("quant_grouped_sequence_lookup needs at least one slot")
    features = features.narrow_ids()  # id words -> int32 rows; wide ids out of range
    ids, _, slot_of, _, valid, caps = slot_positions(features, slots)
    where = f"quantized sequence lookup of {[sl.key for sl in slots]}"
    rows, valid = rows_and_mask(ids, valid, slot_of, slots, bounds_check_mode, where)
    emb = _gather_dequantize(qweights, rows, valid, dim=dim, dtype=dtype)
    return jnp.split(emb, np.cumsum(caps)[:-1].tolist())


@functools.partial(jax.jit, static_argnames=("dim", "dtype"))
def _gather_dequantize(qweights, rows, valid, *, dim, dtype):
    emb = dequantize_rows(jnp.take(qweights, rows, axis=0, mode="clip"), dim, dtype)
    return jnp.where(valid[:, None], emb, 0.0)
