"""64-bit ids without global x64: two 32-bit words per id.

JAX runs with 32-bit integers unless ``jax_enable_x64`` is on, and turning it
on changes every default dtype of a program. Production ids are 64-bit, so
jaxrec carries an id wider than 32 bits as **id words**: a ``uint32[N, 2]``
array whose column 0 is the low word and column 1 the high word of the id's
64-bit two's-complement pattern (int64) or value (uint64). Whatever x64 says,
these are plain 32-bit arrays: they pass through ``jit``, ``shard_map`` and
pytrees unchanged, and the ops that need 64-bit arithmetic (the hash below)
switch x64 on locally, for their own trace only.

::

    id 0x0000_0123_8000_0005  ->  words [0x8000_0005, 0x0000_0123]  (lo, hi)
    id -1 (int64)             ->  words [0xFFFF_FFFF, 0xFFFF_FFFF]

A ``KeyedJaggedTensor`` holds id words as its ``values`` (``[sum(caps), 2]``).
Tables have fewer than ``2**31`` rows, so a plain table lookup narrows the
words to int32 first (:func:`narrow_ids`): an id is in range only if its high
word is 0 and its low word below ``2**31``, every other id becomes ``-1``, which
the bounds check counts as out of range, so a wide id never wraps onto a real
row. Dynamic tables (:class:`~jaxrec.modules.HashZchManagedCollisionModule`)
key rows by all 64 bits (:func:`id_words`, :func:`hash64_words`).

Example:
    >>> w = to_id_words(np.array([2**40 + 5, 7, -1], np.int64))
    >>> w.dtype, w.shape
    (dtype('uint32'), (3, 2))
    >>> from_id_words(w, signed=True).tolist()
    [1099511627781, 7, -1]
    >>> np.asarray(narrow_ids(jnp.asarray(w))).tolist()
    [-1, 7, -1]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

WORD_BITS = 32
_MASK32 = 0xFFFFFFFF
# MurmurHash3's 64-bit finaliser (fmix64): constants and shifts.
_FMIX_C1 = 0xFF51AFD7ED558CCD
_FMIX_C2 = 0xC4CEB9FE1A85EC53
_GOLDEN = 0x9E3779B97F4A7C15  # seeds are spread by this odd constant


def is_wide(values: npt.ArrayLike) -> bool:
    """Whether ``values`` are id words (``uint32[..., N, 2]``) rather than plain ids."""
    shape, dtype = np.shape(values), getattr(values, "dtype", None)
    return len(shape) >= 2 and shape[-1] == 2 and dtype == np.uint32


def to_id_words(ids: npt.ArrayLike) -> np.ndarray:
    """Host ids (any integer dtype, int64/uint64 included) -> ``uint32[N, 2]`` words.

    Signed ids are taken as two's complement (``-1`` is all ones), unsigned
    ones by value. A Python list whose values need 64 bits becomes int64, or
    uint64 past ``2**63 - 1``.
    """
    a = np.asarray(ids)
    if a.dtype == object or (a.size and a.dtype.kind not in "iu"):
        if a.dtype == object:
            big = a.size and max(int(x) for x in a.ravel()) >= 2**63
            a = a.astype(np.uint64 if big else np.int64)
        else:
            raise TypeError(f"ids must be integers, got {a.dtype=}")
    if a.size == 0 and a.dtype.kind not in "iu":
        a = a.astype(np.int64)
    if a.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {a.shape}")
    u = a.astype(np.int64).view(np.uint64) if a.dtype.kind == "i" else a.astype(np.uint64)
    return np.stack([(u & np.uint64(_MASK32)), u >> np.uint64(WORD_BITS)], axis=1).astype(np.uint32)


def from_id_words(words: npt.ArrayLike, *, signed: bool = False) -> np.ndarray:
    """``uint32[N, 2]`` words -> host ids: uint64, or int64 (two's complement) if ``signed``."""
    w = np.asarray(words)
    if not is_wide(w) or w.ndim != 2:
        raise ValueError(f"id words are uint32[N, 2], got {w.dtype} {w.shape}")
    u = (w[:, 1].astype(np.uint64) << np.uint64(WORD_BITS)) | w[:, 0].astype(np.uint64)
    return u.view(np.int64) if signed else u


def id_words(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """In-graph ``(lo, hi)`` uint32 words of ids of any integer dtype.

    id words (``[..., 2]`` uint32) are split; int32 ids sign-extend (``hi`` all
    ones when negative), uint32 and narrower unsigned ids zero-extend; int64 /
    uint64 ids (under x64) are split bit for bit.
    """
    if is_wide(values):
        return values[..., 0], values[..., 1]
    if not jnp.issubdtype(values.dtype, jnp.integer):
        raise TypeError(f"ids must be integers or uint32[..., 2] id words, got {values.dtype=}")
    if values.dtype.itemsize == 8:
        with jax.enable_x64(True):
            u = jax.lax.bitcast_convert_type(values, jnp.uint64)
            lo = (u & jnp.uint64(_MASK32)).astype(jnp.uint32)
            hi = (u >> jnp.uint64(WORD_BITS)).astype(jnp.uint32)
        return lo, hi
    signed = jnp.issubdtype(values.dtype, jnp.signedinteger)
    lo = values.astype(jnp.int32).view(jnp.uint32) if signed else values.astype(jnp.uint32)
    neg = (values < 0) if signed else jnp.zeros(values.shape, bool)
    hi = jnp.where(neg, jnp.uint32(_MASK32), jnp.uint32(0))
    return lo, hi


def narrow_ids(values: jax.Array) -> jax.Array:
    """Row ids for a plain table: id words -> int32, ``-1`` where the id needs more than 31 bits.

    Plain ids (not words) are returned unchanged: the bounds check compares
    them in their own dtype.
    """
    if not is_wide(values):
        return values
    lo, hi = values[..., 0], values[..., 1]
    fits = (hi == 0) & (lo < jnp.uint32(2**31))
    return jnp.where(fits, lo.astype(jnp.int32), jnp.int32(-1))


def _seeded(seed: int) -> int:
    if not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    return (seed * _GOLDEN + _GOLDEN) & (2**64 - 1)


def hash64_words(lo: jax.Array, hi: jax.Array, *, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """In-graph 64-bit hash of 64-bit ids given as words: ``(lo, hi)`` uint32 words.

    MurmurHash3's finaliser (fmix64) of ``id ^ s(seed)``: a bijection of the
    64-bit ids for each seed, so distinct ids never share a hash. Equal to
    :func:`hash64_np` bit for bit.
    """
    s = _seeded(seed)
    with jax.enable_x64(True):  # 64-bit products, local to this trace
        u64 = jnp.uint64
        k = (hi.astype(u64) << u64(WORD_BITS)) | lo.astype(u64)
        k = k ^ u64(s)
        k = k ^ (k >> u64(33))
        k = k * u64(_FMIX_C1)
        k = k ^ (k >> u64(33))
        k = k * u64(_FMIX_C2)
        k = k ^ (k >> u64(33))
        return (k & u64(_MASK32)).astype(jnp.uint32), (k >> u64(WORD_BITS)).astype(jnp.uint32)


def hash64_np(ids: npt.ArrayLike, *, seed: int = 0) -> np.ndarray:
    """Host twin of :func:`hash64_words`: ids (any integer dtype, or words) -> uint64 hashes."""
    a = np.asarray(ids)
    u = from_id_words(a) if is_wide(a) else from_id_words(to_id_words(a))
    with np.errstate(over="ignore"):
        k = u ^ np.uint64(_seeded(seed))
        k ^= k >> np.uint64(33)
        k = k * np.uint64(_FMIX_C1)
        k ^= k >> np.uint64(33)
        k = k * np.uint64(_FMIX_C2)
        k ^= k >> np.uint64(33)
    return k
