"""Initial table values on the C++ kernel ``jaxrec_uniform_rows``: the bits of
``jaxrec.xla.philox.uniform_rows_xla`` (its module docstring defines them), at memory speed.

Raises ``NotImplementedError`` for what the kernel does not take (the dispatcher
then runs XLA): another output dtype, float16 on a build without ``_Float16``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .loader import build_info, load

_OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def uniform_rows_cpu(
    key: jax.Array,
    ints: jax.Array,
    floats: jax.Array,
    *,
    rows: int,
    cols: int,
    dtype,
) -> jax.Array:
    """``jaxrec.xla.philox.uniform_rows_xla`` in one C++ call: a ``[rows, cols]`` buffer.

    Args:
        key: ``uint32[2]`` generator key (``jaxrec.xla.philox.key_words``).
        ints: ``int32[P, 6]`` pieces ``(offset, nrows, stream, row0, col0, width)``,
            sorted by offset (the kernel fails on offsets out of order).
        floats: ``float32[P, 2]``: ``(mid, half)`` per piece.
        rows, cols: the buffer's shape.
        dtype: float32 or bfloat16 (float16 where the build has it).

    Rows and columns no piece covers are zero; a piece's rows past the buffer,
    or past the next piece's offset, and columns past ``cols`` are not drawn, as
    in the reference.
    """
    reason = load()
    if reason is not None:
        raise NotImplementedError(f"jaxrec's C++ CPU kernels are unavailable: {reason}")
    dtype = jnp.dtype(dtype)
    f16 = dtype == jnp.dtype(jnp.float16) and (build_info() or {}).get("uniform_rows_f16")
    if dtype not in _OUT_DTYPES and not f16:
        raise NotImplementedError(f"the CPU kernel does not draw {dtype} buffers")
    for name, a, shape, want in (
        ("key", key, (2,), jnp.uint32),
        ("ints", ints, (None, 6), jnp.int32),
        ("floats", floats, (None, 2), jnp.float32),
    ):
        ok = a.ndim == len(shape) and all(
            s in (None, n) for s, n in zip(shape, a.shape, strict=True)
        )
        if not ok or a.dtype != want:
            form = ", ".join("P" if s is None else str(s) for s in shape)
            raise TypeError(
                f"uniform_rows_cpu: {name} must be {jnp.dtype(want)}[{form}], "
                f"got {a.dtype}{list(a.shape)}"
            )
    if floats.shape[0] != ints.shape[0]:
        raise TypeError(
            f"uniform_rows_cpu: ints and floats describe {ints.shape[0]} and "
            f"{floats.shape[0]} pieces"
        )
    rows, cols = int(rows), int(cols)
    if rows < 0 or cols < 0:
        raise ValueError(f"uniform_rows_cpu: a [{rows}, {cols}] buffer")
    out = jax.ShapeDtypeStruct((rows, cols), dtype)
    call = jax.ffi.ffi_call("jaxrec_uniform_rows", out, vmap_method="sequential")
    return call(key, ints, floats)
