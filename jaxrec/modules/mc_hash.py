"""Id hashing for managed collision: 64-bit raw ids into a 32-bit input range.

JAX runs without x64 by default, so device arrays hold at most 32-bit ids.
Raw ids wider than that (user ids, item ids, hashed strings: int64) are hashed
into ``[0, input_hash_size)`` with ``input_hash_size <= 2**32 - 1`` either on
the host (:func:`hash_ids_64`, exact 64-bit input, numpy) or in-graph from
their two 32-bit halves (:func:`hash_id_pairs`). Both compute the same
function (MurmurHash3 x86_32 of the id's 8 little-endian bytes, then ``% n``),
so a data pipeline may hash on either side. :func:`hash_ids` hashes 32-bit ids
as the 64-bit id they sign- (int32) or zero- (uint32) extend to, and has
TorchRec's ``input_hash_func(ids, input_hash_size)`` signature.

Collisions: distinct 64-bit ids collide in the 32-bit range at the birthday
rate, about ``N**2 / (2 * input_hash_size)`` pairs among ``N`` live ids
(~116 pairs for a million ids in the full range); the managed-collision table
itself is collision-free over the hashed ids.

Example:
    >>> import numpy as np
    >>> h = hash_ids_64(np.array([2**40 + 7, 3], np.int64), 1000)
    >>> bool((h < 1000).all()), h.dtype
    (True, dtype('uint32'))
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

MAX_INPUT_HASH_SIZE = 2**32 - 1  # 2**32 - 1 itself is the empty-slot sentinel

_C1, _C2 = 0xCC9E2D51, 0x1B873593


def _rotl(xp, x, r: int):
    return (x << xp.uint32(r)) | (x >> xp.uint32(32 - r))


def _murmur3_8bytes(xp, hi, lo, seed: int):
    """MurmurHash3 x86_32 of the 8 bytes ``lo, hi`` (little endian), uint32 arithmetic."""
    u = xp.uint32
    h = xp.full(lo.shape, seed, dtype=xp.uint32)
    for k in (lo, hi):
        k = k * u(_C1)
        k = _rotl(xp, k, 15)
        k = k * u(_C2)
        h = h ^ k
        h = _rotl(xp, h, 13)
        h = h * u(5) + u(0xE6546B64)
    h = h ^ u(8)
    h = h ^ (h >> u(16))
    h = h * u(0x85EBCA6B)
    h = h ^ (h >> u(13))
    h = h * u(0xC2B2AE35)
    return h ^ (h >> u(16))


def _check_size(n: object, name: str = "input_hash_size") -> int:
    if not isinstance(n, int | np.integer) or isinstance(n, bool) or not 1 <= n <= 2**32 - 1:
        raise ValueError(f"{name} must be an int in [1, 2**32 - 1], got {n!r}")
    return int(n)


def hash_id_pairs(hi: jax.Array, lo: jax.Array, input_hash_size: int, *, seed: int = 0):
    """Hashes 64-bit ids given as 32-bit halves into ``[0, input_hash_size)`` (in-graph).

    Args:
        hi: ``[...]`` uint32 (or int32, bit pattern used) high 32 bits of each id.
        lo: ``[...]`` uint32 (or int32) low 32 bits.
        input_hash_size: the output range, ``1 <= n <= 2**32 - 1`` (static).
        seed: hash seed (static).

    Returns:
        ``[...]`` uint32 in ``[0, input_hash_size)``, equal to :func:`hash_ids_64`
        of ``(hi << 32) | lo``.
    """
    n = _check_size(input_hash_size)
    hi, lo = (_as_u32_bits(x, name) for x, name in ((hi, "hi"), (lo, "lo")))
    hi, lo = jnp.broadcast_arrays(hi, lo)
    return _murmur3_8bytes(jnp, hi, lo, seed) % jnp.uint32(n)


def hash_ids(ids: jax.Array, input_hash_size: int, *, seed: int = 0) -> jax.Array:
    """Hashes 32-bit ids into ``[0, input_hash_size)`` (in-graph); an ``input_hash_func``.

    int32 ids are sign-extended to 64 bits, uint32 ids zero-extended, so
    ``hash_ids(x, n) == hash_ids_64(x, n)`` for the same integer values.

    Args:
        ids: ``[...]`` int32 or uint32 ids.
        input_hash_size: the output range, ``1 <= n <= 2**32 - 1`` (static).

    Returns:
        ``[...]`` uint32 in ``[0, input_hash_size)``.
    """
    ids = jnp.asarray(ids)
    if ids.dtype not in (jnp.int32, jnp.uint32):
        raise TypeError(
            f"hash_ids takes int32 or uint32 ids, got {ids.dtype=}; hash 64-bit ids on the host "
            "with hash_ids_64 or split them into halves for hash_id_pairs"
        )
    lo = _as_u32_bits(ids, "ids")
    if ids.dtype == jnp.int32:
        hi = jnp.where(ids < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0))
    else:
        hi = jnp.zeros_like(lo)
    return hash_id_pairs(hi, lo, input_hash_size, seed=seed)


def hash_ids_64(
    ids: np.ndarray | Sequence[int], input_hash_size: int, *, seed: int = 0
) -> np.ndarray:
    """Hashes 64-bit ids into ``[0, input_hash_size)`` on the host (numpy, exact).

    Args:
        ids: integer ids (numpy array of any integer dtype, or Python ints that
            fit int64 or uint64); int64 values are taken as two's complement.
        input_hash_size: the output range, ``1 <= n <= 2**32 - 1``.

    Returns:
        uint32 numpy array in ``[0, input_hash_size)``, ready for a
        KeyedJaggedTensor (cast to int32 when ``input_hash_size <= 2**31``
        if a signed dtype is wanted).
    """
    n = _check_size(input_hash_size)
    a = np.asarray(ids)
    if a.dtype == object or (a.size == 0 and a.dtype == np.float64):
        a = np.asarray(ids, dtype=np.uint64 if a.size and max(ids) >= 2**63 else np.int64)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"hash_ids_64 needs integer ids, got {a.dtype=}")
    u = a.astype(np.int64).view(np.uint64) if a.dtype != np.uint64 else a
    hi = (u >> np.uint64(32)).astype(np.uint32)
    lo = (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return _murmur3_8bytes(np, hi, lo, seed) % np.uint32(n)


def _as_u32_bits(x: jax.typing.ArrayLike, name: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype == jnp.uint32:
        return x
    if x.dtype == jnp.int32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    raise TypeError(f"{name} must be uint32 or int32 (a 32-bit word), got {x.dtype=}")
