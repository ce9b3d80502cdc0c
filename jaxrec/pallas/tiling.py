"""Tiling parameters and shape helpers shared by the Pallas kernels.

Triton (the backend, see ``jaxrec/pallas/__init__.py``) needs every block
dimension to be a power of two, so the embedding dim ``D`` is covered by a
column block of ``next_pow2(D)`` lanes and the surplus lanes are masked.
Tuning knobs are frozen dataclasses passed as static arguments; sweeps over
them live in ``bench/gpu_lookup.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import triton_backend
from .triton_backend import pl_triton

FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tiling:
    """Static launch parameters of one kernel.

    Attributes:
        block_rows: bags (forward), positions (gather) or unique rows (update)
            handled by one program; a power of two.
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining stages.
    """

    block_rows: int = 8
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_rows < 1 or self.block_rows & (self.block_rows - 1):
            raise ValueError(f"block_rows must be a power of two, got {self.block_rows}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps}")

    def compiler_params(self) -> pl_triton.CompilerParams:
        """Triton's launch parameters; every kernel launch asks for them first.

        Raises:
            TritonUnavailableError: this JAX has no Pallas Triton backend (a
                ``NotImplementedError``: the dispatcher's callers run XLA).
        """
        triton_backend.require()
        return pl_triton.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
    """A kernel output's type, varying over every mesh axis one of ``inputs`` varies over.

    Inside a ``jax.shard_map`` that checks varying axes (``check_vma=True``, its
    default) Pallas must be told how outputs vary; elsewhere (and under
    ``check_vma=False``, as jaxrec's sharded collections run) no input varies
    and the type is the plain one.
    """
    mats = [jax.typeof(x).manual_axis_type for x in inputs if isinstance(x, jax.Array)]
    varying = frozenset().union(*(getattr(m, "varying", frozenset()) for m in mats))
    if not varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    mat = mats[0].update(varying=varying)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def check_table(weights: jax.Array, name: str = "weights") -> int:
    """Validates a ``[R, D]`` float table and returns ``D``.

    Raises:
        TypeError: not a float32/float16/bfloat16 array.
        ValueError: not 2-D.
        NotImplementedError: ``D`` is not a multiple of 4 (the kernels' contract;
            the dispatcher then falls back to XLA).
    """
    if weights.ndim != 2:
        raise ValueError(f"{name} must be [rows, dim], got {name}.shape={weights.shape}")
    if weights.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {weights.dtype}")
    d = weights.shape[1]
    if d % 4:
        raise NotImplementedError(
            f"Pallas kernels need dim % 4 == 0, got {name}.shape={weights.shape}"
        )
    return d


def check_bags(rows, starts, ends, scale, segment_ids):
    """Validates a pooled lookup's bag arguments; returns ``scale`` (float32, ones
    when None) and ``segment_ids`` (int32 or None)."""
    c, s = rows.shape[0], starts.shape[0]
    check_vector(rows, "rows")
    check_vector(starts, "starts")
    check_vector(ends, "ends", s)
    scale = jnp.ones((c,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    check_vector(scale, "scale", c, kind="f")
    if segment_ids is not None:
        check_vector(segment_ids, "segment_ids", c)
        segment_ids = segment_ids.astype(jnp.int32)
    return scale, segment_ids


def check_vector(x: jax.Array, name: str, length: int | None = None, kind: str = "i") -> None:
    if x.ndim != 1 or (length is not None and x.shape[0] != length):
        want = f"[{length}]" if length is not None else "1-D"
        raise ValueError(f"{name} must be {want}, got {name}.shape={x.shape}")
    if jnp.dtype(x.dtype).kind not in kind:
        raise TypeError(f"{name} has dtype {x.dtype}; expected kind {kind!r}")
