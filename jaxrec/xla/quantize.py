"""Row-wise table quantization in FBGEMM's TBE inference row layout.

Every table row becomes one ``uint8`` row of ``row_bytes(D, dtype)`` bytes,
laid out as FBGEMM's ``IntNBitTableBatchedEmbeddingBagsCodegen`` stores it
(checked against fbgemm-gpu-cpu 1.8, see ``tests/inference/test_quant_layout.py``)::

    INT8 / INT4:  [scale fp16][bias fp16][D (INT8) or D/2 (INT4) data bytes][pad]
    FP16 / BF16:  [2 * D bytes of the row][pad]
    FP32:         [4 * D bytes of the row][pad]

padded to ``row_alignment`` bytes (TorchRec's default 16: a 4096 x 64 float32
table becomes 4096 x 80 uint8 in INT8, as in TorchRec's tutorial). A value is
``q * scale + bias``; INT4 packs two values per byte, the even column in the
low nibble. Quantization follows FBGEMM's
``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`` (which TorchRec's
``quantize_state_dict`` calls): ``bias = fp16(min(row))``,
``scale = fp16((max - bias) / (2**bits - 1))`` (1 for a constant row),
``q = clip(round_half_even((x - bias) / scale), 0, 2**bits - 1)``.

Everything here is pure ``jnp``, jitted with the dtype/dim static (one compile
per shape instead of one per eager op; nested under an outer ``jit`` it inlines).
Dequantization works on any ``[..., row_bytes]`` array, so a lookup can
dequantize only the rows it gathered.
"""

from __future__ import annotations

import functools
from typing import TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from ..configs import DataType

# A quantized table's type: a name ("int8", "int4", "fp16", "bf16", "fp32"), a DataType
# or a JAX float dtype (see canonical_dtype).
QuantDType: TypeAlias = DataType | DTypeLike

QUANT_DTYPES = ("fp32", "fp16", "bf16", "int8", "int4")
DEFAULT_ROW_ALIGNMENT = 16  # TorchRec's DEFAULT_ROW_ALIGNMENT
SCALE_BIAS_BYTES = 4  # fp16 scale + fp16 bias, in front of the data
_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "int4": 4}
_FLOAT = {"fp32": jnp.float32, "fp16": jnp.float16, "bf16": jnp.bfloat16}


def canonical_dtype(dtype: QuantDType) -> str:
    """``"int8" | "int4" | "fp16" | "bf16" | "fp32"`` from a name, ``DataType`` or JAX dtype.

    Raises:
        TypeError: an unsupported type (the message lists the supported ones).
    """
    if isinstance(dtype, DataType):
        dtype = dtype.value
    if isinstance(dtype, str):
        name = dtype.lower().replace("float", "fp").replace("bfloat", "bf")
        name = {"bfp16": "bf16", "uint8": "int8"}.get(name, name)
        if name in QUANT_DTYPES:
            return name
    else:
        try:
            name = {jnp.dtype(v): k for k, v in _FLOAT.items()}.get(jnp.dtype(dtype))
        except TypeError:
            name = None
        if name is not None:
            return name
    raise TypeError(
        f"unsupported quantized table dtype {dtype!r}; use one of {QUANT_DTYPES} "
        "(or DataType.FP32/FP16/BF16, jnp.float16, jnp.bfloat16)"
    )


def is_integer(dtype) -> bool:
    """Whether rows of ``dtype`` carry a scale and bias (INT8, INT4)."""
    return canonical_dtype(dtype) in ("int8", "int4")


def data_bytes(dim: int, dtype) -> int:
    """Bytes of one row's values, without scale/bias or padding."""
    name = canonical_dtype(dtype)
    if name == "int4" and dim % 2:
        raise ValueError(f"INT4 packs two values per byte: embedding_dim must be even, got {dim}")
    return dim * _BITS[name] // 8


def row_bytes(dim: int, dtype, row_alignment: int = DEFAULT_ROW_ALIGNMENT) -> int:
    """Bytes per stored row: data (+ 4 scale/bias bytes for INT8/INT4), padded.

    Example:
        >>> row_bytes(64, "int8"), row_bytes(64, "int4"), row_bytes(64, "fp16")
        (80, 48, 128)
    """
    if row_alignment < 1:
        raise ValueError(f"row_alignment must be >= 1, got {row_alignment}")
    n = data_bytes(dim, dtype) + (SCALE_BIAS_BYTES if is_integer(dtype) else 0)
    return -(-n // row_alignment) * row_alignment


def _check_table(weights, name="weights") -> None:
    if weights.ndim != 2:
        raise ValueError(f"{name} must be [rows, dim], got {name}.shape={weights.shape}")
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"{name} must be a float array, got dtype {weights.dtype}")


def _bytes_of(x: jax.Array) -> jax.Array:
    """``[..., n]`` of a 2- or 4-byte type -> ``[..., n * bytes]`` uint8 (little-endian)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint8)  # [..., n, bytes]
    return b.reshape(*x.shape[:-1], -1)


@functools.partial(jax.jit, static_argnames=("dtype", "row_alignment"))
def quantize_rows(
    weights: jax.typing.ArrayLike, dtype, *, row_alignment: int = DEFAULT_ROW_ALIGNMENT
) -> jax.Array:
    """Quantizes a ``[E, D]`` float table into ``[E, row_bytes(D, dtype)]`` uint8 rows.

    Args:
        weights: ``[E, D]`` float table (float32, float16 or bfloat16).
        dtype: ``"int8"``, ``"int4"``, ``"fp16"``, ``"bf16"`` or ``"fp32"``.
        row_alignment: pad every row to a multiple of this many bytes.

    Returns:
        ``[E, row_bytes]`` uint8 in FBGEMM's TBE inference row layout.

    Example:
        >>> quantize_rows(jnp.zeros((4096, 64)), "int8").shape
        (4096, 80)
    """
    weights = jnp.asarray(weights)
    _check_table(weights)
    name = canonical_dtype(dtype)
    e, d = weights.shape
    width = row_bytes(d, name, row_alignment)
    if name in _FLOAT:
        data = _bytes_of(weights.astype(_FLOAT[name]))
    else:
        x = weights.astype(jnp.float32)
        levels = (1 << _BITS[name]) - 1
        bias = jnp.min(x, axis=1).astype(jnp.float16)
        lo = bias.astype(jnp.float32)
        rng = jnp.max(x, axis=1) - lo
        scale = jnp.where(rng == 0, 1.0, rng / levels).astype(jnp.float16)
        inv = 1.0 / scale.astype(jnp.float32)
        bad = (scale == 0) | ~jnp.isfinite(inv)
        scale = jnp.where(bad, jnp.float16(1.0), scale)
        inv = jnp.where(bad, 1.0, inv)
        q = jnp.clip(jnp.round((x - lo[:, None]) * inv[:, None]), 0, levels).astype(jnp.uint8)
        if name == "int4":
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        sb = _bytes_of(jnp.stack([scale, bias], axis=1))  # [E, 4]
        data = jnp.concatenate([sb, q], axis=1)
    return jnp.pad(data, ((0, 0), (0, width - data.shape[1])))


def _from_bytes(data: jax.Array, dtype) -> jax.Array:
    """Little-endian byte groups ``[..., n]`` -> ``dtype`` values ``[...]``.

    Bytes are first combined into an n-byte unsigned int, then bitcast at equal
    width: a width-changing bitcast cannot be shape-refined under a symbolic
    batch (``jax.export``).
    """
    n = data.shape[-1]
    uint = {2: jnp.uint16, 4: jnp.uint32}[n]
    word = data[..., 0].astype(uint)
    for i in range(1, n):
        word = word | (data[..., i].astype(uint) << (8 * i))
    return jax.lax.bitcast_convert_type(word, dtype)


def scale_bias(rows: jax.Array, dtype=None) -> tuple[jax.Array, jax.Array]:
    """``(scale, bias)`` float32 ``[...]`` of INT8/INT4 rows ``[..., row_bytes]``."""
    if dtype is not None and not is_integer(dtype):
        raise TypeError(f"{canonical_dtype(dtype)} rows have no scale/bias")
    sb = rows[..., :SCALE_BIAS_BYTES].reshape(*rows.shape[:-1], 2, 2)
    sb = _from_bytes(sb, jnp.float16).astype(jnp.float32)
    return sb[..., 0], sb[..., 1]


@functools.partial(jax.jit, static_argnames=("dim", "dtype"))
def dequantize_rows(rows: jax.typing.ArrayLike, dim: int, dtype) -> jax.Array:
    """Float32 values ``[..., dim]`` of quantized rows ``[..., row_bytes]`` (any leading dims).

    Args:
        rows: uint8 rows from :func:`quantize_rows` (or gathered from them).
        dim: the embedding dim ``D``.
        dtype: the rows' quantized type.

    Raises:
        TypeError: ``rows`` is not uint8 or ``dtype`` is unsupported.
        ValueError: rows narrower than the data they must hold.
    """
    rows = jnp.asarray(rows)
    name = canonical_dtype(dtype)
    if rows.dtype != jnp.uint8:
        raise TypeError(f"quantized rows must be uint8, got {rows.dtype}")
    need = data_bytes(dim, name) + (SCALE_BIAS_BYTES if is_integer(name) else 0)
    if rows.ndim < 1 or rows.shape[-1] < need:
        raise ValueError(
            f"{name} rows of dim {dim} need at least {need} bytes, got rows.shape={rows.shape}"
        )
    lead = rows.shape[:-1]
    if name in _FLOAT:
        n = _BITS[name] // 8
        data = rows[..., : dim * n].reshape(*lead, dim, n)
        return _from_bytes(data, _FLOAT[name]).astype(jnp.float32)
    scale, bias = scale_bias(rows)
    data = rows[..., SCALE_BIAS_BYTES : SCALE_BIAS_BYTES + data_bytes(dim, name)]
    if name == "int4":
        data = jnp.stack([data & 0xF, data >> 4], axis=-1).reshape(*lead, dim)
    return data.astype(jnp.float32) * scale[..., None] + bias[..., None]


def dequantize_table(rows: jax.typing.ArrayLike, dim: int, dtype) -> np.ndarray:
    """A whole ``[E, D]`` float32 table on the host (for tests and exports, never lookups)."""
    return np.asarray(dequantize_rows(rows, dim, dtype))


@functools.partial(jax.jit, static_argnames=("dtype",))
def row_error_bound(weights: jax.typing.ArrayLike, rows: jax.Array, dtype) -> jax.Array:
    """Per-row bound ``[E]`` on ``|dequantize(quantize(w)) - w|``, from the stored rows.

    INT8/INT4: ``scale / 2`` for in-range values, or the clamp error at the row's
    ends when fp16 rounding of scale/bias moved them (FBGEMM's formula clamps).
    FP16/BF16: half an ulp of the row's largest magnitude; FP32: 0.
    """
    w = jnp.asarray(weights, jnp.float32)
    name = canonical_dtype(dtype)
    if name == "fp32":
        return jnp.zeros(w.shape[:1], jnp.float32)
    if name in _FLOAT:
        eps = float(jnp.finfo(_FLOAT[name]).eps)
        return jnp.max(jnp.abs(w), axis=1) * eps  # >= half an ulp (normal range)
    scale, bias = scale_bias(rows)
    levels = (1 << _BITS[name]) - 1
    top = jnp.max(w, axis=1) - bias - levels * scale
    low = bias - jnp.min(w, axis=1)
    return jnp.maximum(jnp.maximum(scale / 2, top), low) * (1 + 1e-6) + 1e-7
