"""Dequantizing table-batched pooled lookup (FBGEMM's INT8/INT4 TBE inference forward).

The quantized twin of :mod:`jaxrec.pallas.pooled`: the table is ``[R, W]``
uint8 rows in FBGEMM's TBE inference layout (``[scale fp16][bias fp16][data]``,
see ``jaxrec.xla.quantize``). Each program owns ``block_rows`` bags and
walks their ids in lock step: one step loads one id per bag, that row's scale
and bias (four bytes) and its ``[block_rows, next_pow2(D)]`` data bytes (INT4:
the byte holding each column, then its nibble), dequantizes
``q * scale + bias`` in float32 and accumulates. The float table never exists,
in HBM or anywhere else.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..xla.quantize import dequantize_rows
from .pooled import ranges_from_segments
from .tiling import Tiling, check_bags, next_pow2, out_struct
from .triton_backend import pl_triton

DEFAULT_TILING = Tiling(block_rows=8, num_warps=4, num_stages=2)
KERNEL_DTYPES = ("int8", "int4")
_SB = 4  # scale (fp16) + bias (fp16) bytes in front of each row


def _half(lo, hi):
    """float32 of the little-endian fp16 whose bytes are ``lo``, ``hi`` (uint8 vectors)."""
    bits = lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def quant_pooled_lookup_kernel(
    qweights_ref,  # [R, W] uint8 TBE rows
    rows_ref,  # [C] int32 stacked-buffer rows
    scale_ref,  # [C] float32 per-id multiplier (0 drops an id)
    starts_ref,  # [S] int32 first position of each bag
    ends_ref,  # [S] int32 one past the last position
    seg_ref,  # [C] int32 owning bag of each position, or None (no check)
    out_ref,  # [S, D] float32
    *,
    num_bags: int,
    num_rows: int,
    dim: int,
    int4: bool,
    block_bags: int,
    mean: bool,
):
    bags = pl.program_id(0) * block_bags + jnp.arange(block_bags, dtype=jnp.int32)
    bag_ok = bags < num_bags
    cols = jnp.arange(next_pow2(dim), dtype=jnp.int32)
    col_ok = cols < dim
    byte_col = _SB + (cols // 2 if int4 else cols)
    shift = ((cols % 2) * 4).astype(jnp.uint8) if int4 else None
    start = pl_triton.load(starts_ref.at[bags], mask=bag_ok, other=0)
    length = pl_triton.load(ends_ref.at[bags], mask=bag_ok, other=0) - start
    length = jnp.maximum(length, 0)
    steps = jnp.max(length)

    def body(j, acc):
        live = bag_ok & (j < length)
        pos = jnp.where(live, start + j, 0)
        row = pl_triton.load(rows_ref.at[pos], mask=live, other=0)
        if seg_ref is not None:  # positions inside the range owned by another bag
            live = live & (pl_triton.load(seg_ref.at[pos], mask=live, other=-1) == bags)
        w = pl_triton.load(scale_ref.at[pos], mask=live, other=0.0)
        row = jnp.clip(row, 0, num_rows - 1)  # as XLA's clamped gather
        sb = [pl_triton.load(qweights_ref.at[row, k], mask=live, other=0) for k in range(_SB)]
        scale, bias = _half(sb[0], sb[1]), _half(sb[2], sb[3])
        q = pl_triton.load(
            qweights_ref.at[row[:, None], byte_col[None, :]],
            mask=live[:, None] & col_ok[None, :],
            other=0,
        )
        if shift is not None:  # int4
            q = (q >> shift[None, :]) & 0xF
        emb = q.astype(jnp.float32) * scale[:, None] + bias[:, None]
        return acc + emb * w[:, None]  # w == 0 on dead lanes: their bias drops too

    acc = jnp.zeros((block_bags, cols.shape[0]), jnp.float32)
    acc = jax.lax.fori_loop(0, steps, body, acc)
    if mean:
        acc = acc / jnp.maximum(length, 1).astype(jnp.float32)[:, None]
    pl_triton.store(
        out_ref.at[bags[:, None], cols[None, :]],
        acc,
        mask=bag_ok[:, None] & col_ok[None, :],
    )


def _check(qweights, dim, dtype):
    if qweights.ndim != 2 or qweights.dtype != jnp.uint8:
        raise TypeError(
            f"qweights must be [rows, bytes] uint8, got {qweights.shape=} {qweights.dtype=}"
        )
    if dtype not in KERNEL_DTYPES:
        raise NotImplementedError(
            f"the quantized lookup kernel handles {KERNEL_DTYPES}, got {dtype!r}"
        )
    need = _SB + (dim // 2 if dtype == "int4" else dim)
    if dim < 1 or (dtype == "int4" and dim % 2) or qweights.shape[1] < need:
        raise ValueError(
            f"{dtype} rows of dim {dim} need {need} bytes (INT4: an even dim), "
            f"got qweights.shape={qweights.shape}"
        )


@functools.partial(jax.jit, static_argnames=("dim", "dtype", "mean", "tiling", "interpret"))
def quant_pooled_lookup(
    qweights: jax.Array,
    rows: jax.Array,
    starts: jax.Array,
    ends: jax.Array,
    scale: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    *,
    dim: int,
    dtype: str,
    mean: bool = False,
    tiling: Tiling = DEFAULT_TILING,
    interpret: bool = False,
) -> jax.Array:
    """Dequantizing pooled lookup of ``S`` bags over stacked INT8/INT4 rows, one launch.

    Args:
        qweights: ``[R, W]`` uint8 rows (``jaxrec.inference.quantize_rows``).
        rows: ``[C]`` int rows; out-of-range rows are clamped into ``[0, R)``.
        starts, ends: ``[S]`` int32 position range of each bag (``ends <= starts``: empty).
        scale: optional ``[C]`` float per-id multiplier (0 drops an id).
        segment_ids: optional ``[C]`` owning bag per position (ranges may then overlap).
        dim: the embedding dim ``D`` (any; INT4 needs it even).
        dtype: ``"int8"`` or ``"int4"``.
        mean: divide each bag by its range length.
        tiling: static launch parameters.
        interpret: run in the Pallas interpreter (any backend).

    Returns:
        ``[S, D]`` float32.

    Raises:
        NotImplementedError: another dtype (FP16/BF16 rows go through XLA).
    """
    _check(qweights, dim, dtype)
    c, s = rows.shape[0], starts.shape[0]
    scale, segment_ids = check_bags(rows, starts, ends, scale, segment_ids)
    if c == 0 or s == 0 or qweights.shape[0] == 0:
        return jnp.zeros((s, dim), jnp.float32)
    block = tiling.block_rows
    kernel = functools.partial(
        quant_pooled_lookup_kernel if segment_ids is not None else _no_seg,
        num_bags=s,
        num_rows=qweights.shape[0],
        dim=dim,
        int4=dtype == "int4",
        block_bags=block,
        mean=mean,
    )
    args = [qweights, rows.astype(jnp.int32), scale, starts.astype(jnp.int32)]
    args += [ends.astype(jnp.int32)] + ([segment_ids] if segment_ids is not None else [])
    return pl.pallas_call(
        kernel,
        out_shape=out_struct((s, dim), jnp.float32, *args),
        grid=(pl.cdiv(s, block),),
        compiler_params=tiling.compiler_params(),
        interpret=interpret,
        name="jaxrec_quant_pooled_lookup",
    )(*args)


def _no_seg(w, rows, scale, starts, ends, out, **kw):
    return quant_pooled_lookup_kernel(w, rows, scale, starts, ends, None, out, **kw)


def quant_pooled_lookup_reference(
    qweights, rows, starts, ends, scale=None, segment_ids=None, *, dim, dtype, mean=False
) -> jax.Array:
    """Pure-jnp :func:`quant_pooled_lookup` (same arguments and clamping): the tests' oracle."""
    c, s = rows.shape[0], starts.shape[0]
    pos = jnp.arange(c, dtype=jnp.int32)
    inside = (pos[None, :] >= starts[:, None]) & (pos[None, :] < ends[:, None])  # [S, C]
    if segment_ids is not None:
        inside = inside & (segment_ids[None, :] == jnp.arange(s)[:, None])
    scale = jnp.ones((c,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    packed = jnp.take(qweights, rows, axis=0, mode="clip")
    emb = dequantize_rows(packed, dim, dtype) * scale[:, None]
    # HIGHEST: a default-precision matmul is TF32 on Hopper, too coarse for an oracle.
    hi = jax.lax.Precision.HIGHEST
    out = jnp.matmul(jnp.where(inside, 1.0, 0.0), emb, precision=hi) if c else jnp.zeros((s, dim))
    if mean:
        out = out / jnp.maximum(ends - starts, 1).astype(jnp.float32)[:, None]
    return out.astype(jnp.float32)


def quant_embedding_bag_pallas(
    qweights, rows, segment_ids, num_segments, per_value_scale=None, *, dim, dtype, interpret
):
    """``jaxrec.inference.quant_embedding_bag`` on :func:`quant_pooled_lookup`."""
    if dtype not in KERNEL_DTYPES:
        raise NotImplementedError(f"no quantized lookup kernel for {dtype!r}")  # -> XLA
    segment_ids = segment_ids.astype(jnp.int32)
    starts, ends = ranges_from_segments(segment_ids, num_segments)
    scale = jnp.ones(rows.shape, jnp.float32) if per_value_scale is None else per_value_scale
    scale = jnp.where(segment_ids < num_segments, scale.astype(jnp.float32), 0.0)
    return quant_pooled_lookup(
        qweights,
        rows,
        starts,
        ends,
        scale,
        segment_ids,
        dim=dim,
        dtype=dtype,
        interpret=interpret,
    )
