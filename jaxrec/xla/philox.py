"""Initial table values from a counter-based generator: Philox4x32-10, addressed by element.

A table's value at ``(row, col)`` is a pure function of the collection's key, the
table's index in its collection (its *stream*), ``row`` and ``col``: so a shard of
rows and columns draws exactly its own values, on its own device, and they equal
the values of the whole table drawn anywhere else (the plan, world size, process
count and grouping do not change them).

The generator is Philox4x32 with 10 rounds (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011; the generator of cuRAND, numpy's
``Philox`` family and JAX's ``rbg`` on GPUs): a 128-bit counter and a 64-bit key
give four 32-bit words. Element ``(row, col)`` of stream ``s`` is word
``col % 4`` of the counter ``(row, 0, col // 4, s)``. Its float is
``u = float32((w >> 9) | 0x3f800000) - 1`` in ``[0, 1)`` (23 random bits, as
``jax.random.uniform``), then ``float32(mid + half * (2u - 1))`` with ``mid``,
``half`` the float32 centre and half-width of ``[lo, hi)`` and the sum taken in
float64, where the product is exact (so a compiler's multiply-add contraction
changes nothing; for TorchRec's symmetric default ``mid = 0`` it is the float32
product), cast to the table's dtype.

This module is the XLA path (any platform; on GPUs it is the only path); the C++
kernel ``jaxrec_uniform_rows`` (``jaxrec.cpu``) writes the same bits at memory
speed on CPUs, and ``jaxrec.ops.init`` dispatches between them.

A buffer is described by *pieces*, one per block of rows of one table:
``ints[p] = (offset, nrows, stream, row0, col0, width)``: buffer rows
``[offset, offset + nrows)`` hold rows ``[row0, row0 + nrows)`` of stream
``stream``, columns ``[col0, col0 + width)`` in buffer columns ``[0, width)``;
``floats[p] = (mid, half)``. Pieces are sorted by ``offset`` and do not overlap;
buffer rows and columns no piece covers are zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key increments (Weyl sequence)
ROUNDS = 10
PIECE_FIELDS = ("offset", "nrows", "stream", "row0", "col0", "width")
BLOCK_VALUES = 1 << 22  # values per block of rows drawn at once (bounds the temporaries)


def _mulhilo(a: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """High and low words of the 64-bit product ``a * m`` (uint32 in and out; call
    under ``jax.enable_x64``)."""
    u32, u64 = jnp.uint32, jnp.uint64
    p = lax.mul(lax.convert_element_type(a, u64), lax.full_like(a, m, u64))
    hi = lax.shift_right_logical(p, lax.full_like(p, 32))
    return lax.convert_element_type(hi, u32), lax.convert_element_type(p, u32)


def philox4x32(counter: tuple[jax.Array, ...], key: tuple[jax.Array, jax.Array]):
    """Philox4x32-10 of ``counter`` (four uint32 arrays, broadcast together) under ``key``
    (two uint32 scalars or arrays): four uint32 words."""
    shape = jnp.broadcast_shapes(*(jnp.shape(c) for c in counter))
    c0, c1, c2, c3 = (jnp.broadcast_to(jnp.asarray(c, jnp.uint32), shape) for c in counter)
    k0, k1 = (jnp.broadcast_to(jnp.asarray(k, jnp.uint32), shape) for k in key)
    # x64 on for the 64-bit products only, once: each switch of the flag misses
    # JAX's caches of traced ops.
    with jax.enable_x64(True):
        for r in range(ROUNDS):
            if r:
                k0 = lax.add(k0, lax.full_like(k0, PHILOX_W[0]))
                k1 = lax.add(k1, lax.full_like(k1, PHILOX_W[1]))
            hi0, lo0 = _mulhilo(c0, PHILOX_M[0])
            hi1, lo1 = _mulhilo(c2, PHILOX_M[1])
            xor = lax.bitwise_xor
            c0, c1, c2, c3 = xor(xor(hi1, c1), k0), lo1, xor(xor(hi0, c3), k1), lo0
    return c0, c1, c2, c3


def unit_float(words: jax.Array) -> jax.Array:
    """``[0, 1)`` float32 from uint32 words (their top 23 bits)."""
    bits = (words >> jnp.uint32(9)) | jnp.uint32(0x3F800000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(1.0)


def key_words(key: jax.Array) -> jax.Array:
    """The generator's 64-bit key (``uint32[2]``) of a JAX key (any ``impl``), or of
    ``uint32[2]`` words given directly."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.bits(key, (2,), jnp.uint32)
    if key.shape != (2,) or key.dtype != jnp.uint32:
        raise TypeError(f"key must be a JAX key or uint32[2] words, got {key.shape=} {key.dtype=}")
    return key


def uniform_rows_xla(
    key: jax.Array,
    ints: jax.Array,
    floats: jax.Array,
    *,
    rows: int,
    cols: int,
    dtype,
    aligned: bool = False,
) -> jax.Array:
    """A ``[rows, cols]`` buffer of ``dtype`` drawn as the pieces say (module docstring).

    Args:
        key: ``uint32[2]`` generator key (:func:`key_words`).
        ints: ``int32[P, 6]`` pieces (``PIECE_FIELDS``), sorted by offset; ``P >= 1``
            (pad with ``nrows = 0`` pieces at ``offset = rows``).
        floats: ``float32[P, 2]``: ``(mid, half)`` per piece.
        rows, cols: the buffer's shape.
        dtype: the buffer's dtype (values drawn in float32, then cast).
        aligned: every piece's ``col0`` is a multiple of 4 (a faster program;
            the caller knows it from the pieces on the host).
    """
    dtype = jnp.dtype(dtype)
    ints, floats = jnp.asarray(ints, jnp.int32), jnp.asarray(floats, jnp.float32)
    if rows == 0 or cols == 0:
        return jnp.zeros((rows, cols), dtype)
    block = max(1, min(rows, BLOCK_VALUES // cols))
    if block == rows:
        return _rows_block(key, ints, floats, jnp.int32(0), block, cols, aligned).astype(dtype)

    def body(i, buf):
        # The last block starts early instead of running past the end: the rows it
        # draws again get the same values (a row's values depend only on the row).
        start = jnp.minimum(i * block, rows - block).astype(jnp.int32)
        part = _rows_block(key, ints, floats, start, block, cols, aligned).astype(dtype)
        return jax.lax.dynamic_update_slice(buf, part, (start, jnp.int32(0)))

    n = -(-rows // block)
    return jax.lax.fori_loop(0, n, body, _varying_like(jnp.zeros((rows, cols), dtype), ints))


def _varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` typed to vary over the mesh axes ``like`` varies over (inside a ``shard_map``,
    a loop's carry must keep its type; a no-op elsewhere)."""
    vary = lambda a: set(getattr(getattr(jax.typeof(a), "mat", None), "varying", ()))  # noqa: E731
    missing = tuple(sorted(vary(like) - vary(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _rows_block(key, ints, floats, start, block: int, cols: int, aligned: bool) -> jax.Array:
    """Float32 values of buffer rows ``[start, start + block)``; ``aligned``: every
    piece's ``col0`` is a multiple of 4."""
    r = start + jnp.arange(block, dtype=jnp.int32)
    p = jnp.searchsorted(ints[:, 0], r, side="right") - 1  # last piece starting at or before
    p = jnp.clip(p, 0, ints.shape[0] - 1)
    offset, nrows, stream, row0, col0, width = (ints[p, k] for k in range(6))
    i = r - offset
    in_piece = (r >= offset) & (i < nrows)
    row = (row0 + i).astype(jnp.uint32)
    # Counters (row, 0, col0 // 4 + t, stream) for t in [0, T): their words cover the
    # columns col0 .. col0 + cols - 1 of the row, starting at word col0 % 4.
    t_count = (cols + 3) // 4 + (0 if aligned else 1)
    t = jnp.arange(t_count, dtype=jnp.uint32)
    q = (col0 >> 2).astype(jnp.uint32)[:, None] + t[None, :]
    zero = jnp.zeros((), jnp.uint32)
    words = philox4x32(
        (row[:, None], zero, q, stream.astype(jnp.uint32)[:, None]), (key[0], key[1])
    )
    # Materialised once: fused into the consumers below, each output element would
    # compute its counter's whole Philox again (four words per counter, four times).
    words = jax.lax.optimization_barrier(words)
    flat = jnp.stack(words, axis=-1).reshape(block, 4 * t_count)  # word 4t + k = lane k of t
    if aligned:  # every piece starts on the 4-word grid (whole tables, most shards)
        picked = flat[:, 0:cols]
    else:  # column shards off the grid: the row's words from col0 % 4 on
        shift = col0 & 3
        picked = flat[:, 0:cols]
        for s in (1, 2, 3):
            picked = jnp.where((shift == s)[:, None], flat[:, s : s + cols], picked)
    u = unit_float(picked)
    mid, half = floats[p, 0][:, None], floats[p, 1][:, None]
    t = u * jnp.float32(2.0) - jnp.float32(1.0)  # exact
    with jax.enable_x64(True):  # the product (24 x 23 bits) is exact in float64: one
        # definition whether or not XLA contracts the multiply-add
        f64 = jnp.float64
        wide = lax.add(lax.mul(half.astype(f64), t.astype(f64)), mid.astype(f64))
        values = lax.convert_element_type(wide, jnp.float32)
    j = jnp.arange(cols, dtype=jnp.int32)[None, :]
    keep = in_piece[:, None] & (j < width[:, None])
    return jnp.where(keep, values, jnp.float32(0.0))


def piece_arrays(pieces, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ints int32[P, 6], floats float32[P, 2])`` of ``pieces`` (each a mapping or record
    with ``PIECE_FIELDS`` plus ``lo``, ``hi``), sorted by offset, padded to one piece."""
    out = sorted(pieces, key=lambda p: (int(p.offset), int(p.nrows)))
    ints = np.array(
        [[int(getattr(p, f)) for f in PIECE_FIELDS] for p in out] or [[rows, 0, 0, 0, 0, 0]],
        np.int64,
    )
    if ints.size and (ints.max() > np.iinfo(np.int32).max or ints.min() < 0):
        raise ValueError(
            "table pieces need offsets, rows and columns in [0, 2**31): got "
            f"{ints.min()}..{ints.max()}"
        )
    lo = np.array([np.float32(p.lo) for p in out] or [0.0], np.float32)
    hi = np.array([np.float32(p.hi) for p in out] or [0.0], np.float32)
    floats = np.stack([(lo + hi) / np.float32(2), (hi - lo) / np.float32(2)], axis=1)
    return ints.astype(np.int32), floats.astype(np.float32)
