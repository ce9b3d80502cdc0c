"""Array conversion and input checks shared by the sparse types.

Shape and dtype checks run at trace time on every call. Value checks (negative
lengths, overflowing capacities) need concrete values, so they run on the host
path only: when the caller passes numpy arrays or lists, or asks with
``validate=True``. Traced values are never pulled to the host.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import jax
import jax.core  # jax.core.Tracer: a submodule the type checker sees only when imported
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from .ids64 import is_wide, to_id_words


def is_traced(x: object) -> TypeGuard[jax.Array]:  # a Tracer types as a jax.Array
    return isinstance(x, jax.core.Tracer)


def is_host(x: object) -> bool:
    """True for inputs that live on the host (numpy arrays, lists, scalars)."""
    return isinstance(x, np.ndarray | list | tuple | int | float | np.generic)


def to_host(x: npt.ArrayLike) -> np.ndarray:
    if is_traced(x):
        raise TypeError(
            "this method needs concrete values but got a traced array; call it outside "
            "jax.jit (it is a host-side helper)"
        )
    return np.asarray(x)


def _int32_ok(a: np.ndarray) -> bool:
    if a.size == 0:
        return True
    return int(a.min()) >= np.iinfo(np.int32).min and int(a.max()) <= np.iinfo(np.int32).max


def as_int_array(x: npt.ArrayLike, name: str) -> jax.Array:
    """Converts ids or lengths to a JAX integer array, checking the dtype.

    64-bit host integers are narrowed to int32 when JAX runs without x64 (the
    default); values that do not fit are an error rather than a silent wrap
    (ids use :func:`as_ids_array`, which makes them id words instead).
    """
    if is_traced(x) or isinstance(x, jax.Array):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(
                f"{name} must have an integer dtype, got {x.dtype=}; cast with .astype(jnp.int32)"
            )
        return x
    return jnp.asarray(host_int_array(x, name))


def as_ids_array(x: npt.ArrayLike, name: str) -> jax.Array:
    """Converts ids to a JAX array: integers, or ``uint32[N, 2]`` id words (``ids64``).

    As :func:`as_int_array`, except that 64-bit host ids that do not fit int32
    (x64 off) become id words instead of an error.
    """
    if is_traced(x) or isinstance(x, jax.Array):
        return as_int_array(x, name)
    return jnp.asarray(host_ids_array(x, name))


def host_ids_array(x: npt.ArrayLike, name: str) -> np.ndarray:
    """:func:`as_ids_array` for host inputs, staying on the host (numpy).

    Without x64, int64 / uint64 ids that fit int32 narrow to int32 (most callers
    pass numpy int64 arrays of small ids); if any id of the array does not fit,
    the whole array becomes id words. The representation then depends on the
    values (a new one retraces a jitted step): pass ``to_id_words(ids)`` to fix
    it for a whole stream. Under x64 the dtype is kept.
    """
    a = untyped_empty_as_int(np.asarray(x), x)
    wide64 = np.issubdtype(a.dtype, np.integer) and a.ndim == 1 and a.dtype.itemsize == 8
    if wide64 and not jax.config.read("jax_enable_x64") and not _int32_ok(a):
        return to_id_words(a)
    a = host_int_array(a, name)
    if a.ndim != 1 and not is_wide(a):
        raise ValueError(
            f"{name} must be 1-D ids or uint32[N, 2] id words (jaxrec.sparse.to_id_words), "
            f"got {a.dtype} {a.shape}"
        )
    return a


def untyped_empty_as_int(a: np.ndarray, x: npt.ArrayLike) -> np.ndarray:
    """``a = np.asarray(x)``, as int32 when ``x`` is an empty Python list (it carries no dtype)."""
    if a.size == 0 and a.dtype == np.float64 and not isinstance(x, np.ndarray):
        return a.astype(np.int32)
    return a


def host_int_array(x: npt.ArrayLike, name: str) -> np.ndarray:
    """:func:`as_int_array` for host inputs, staying on the host (numpy)."""
    a = untyped_empty_as_int(np.asarray(x), x)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(
            f"{name} must have an integer dtype, got {a.dtype=}; ids and lengths are integers"
        )
    if a.dtype.itemsize == 8 and not jax.config.read("jax_enable_x64"):
        if not _int32_ok(a):
            raise ValueError(
                f"{name} holds values outside int32 range (max {a.max()}) and JAX x64 is off"
            )
        a = a.astype(np.int32)
    return a


def as_float_array(x: npt.ArrayLike, name: str) -> jax.Array:
    if is_traced(x) or isinstance(x, jax.Array):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating dtype, got {x.dtype=}")
        return x
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        if np.issubdtype(a.dtype, np.integer) and not isinstance(x, np.ndarray):
            a = a.astype(np.float32)  # plain Python lists of ints are fine as weights
        else:
            raise TypeError(f"{name} must have a floating dtype, got {a.dtype=}")
    if a.dtype == np.float64 and not jax.config.read("jax_enable_x64"):
        a = a.astype(np.float32)
    return jnp.asarray(a)


def as_values_array(x: npt.ArrayLike, name: str) -> jax.Array:
    """Values of a JaggedTensor: ids (integer or id words) or embeddings (floating)."""
    if is_traced(x) or isinstance(x, jax.Array):
        return x
    a = np.asarray(x)
    if np.issubdtype(a.dtype, np.integer) and a.ndim == 1:
        return as_ids_array(a, name)  # ids: 64-bit ones may become id words
    if np.issubdtype(a.dtype, np.integer) or (a.size == 0 and a.dtype == np.float64):
        return as_int_array(a if a.size else a.astype(np.int32), name)
    return as_float_array(a, name)


def check_finite_weights(weights: npt.ArrayLike, name: str = "weights") -> None:
    """Host value check: per-sample weights must be finite (NaN / inf would poison a bag)."""
    w = to_host(weights)
    if w.size and not np.all(np.isfinite(w)):
        bad = int(np.flatnonzero(~np.isfinite(w))[0])
        raise ValueError(
            f"{name} must be finite, got {name}[{bad}]={w[bad]}; drop or fix the sample "
            "before building the batch"
        )


def check_rank(x: jax.Array, rank: int, name: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must be {rank}-D, got {x.shape=}")


def check_lengths_values(lengths: np.ndarray, capacity: int, name: str = "lengths") -> None:
    """Host value check: no negative lengths, total within capacity."""
    if lengths.size and lengths.min() < 0:
        bad = int(np.flatnonzero(lengths < 0)[0])
        raise ValueError(f"{name} must be non-negative, got {name}[{bad}]={lengths[bad]}")
    total = int(lengths.sum())
    if total > capacity:
        raise ValueError(
            f"sum({name})={total} exceeds the capacity {capacity} (values length); "
            "pass values at least as long as sum(lengths) or a larger capacity"
        )


def lengths_from_offsets(offsets: Any) -> np.ndarray | jax.Array:
    # Any: host offsets (any sequence) or a jax.Array, told apart by is_host at run time
    """Lengths from TorchRec offsets ``[0, o_1, ..., o_n]``, checking them on the host."""
    if is_host(offsets):
        o = np.asarray(offsets)
        if o.ndim != 1 or o.size == 0:
            raise ValueError(f"offsets must be 1-D with at least one entry, got {o.shape=}")
        if o[0] != 0:
            raise ValueError(f"offsets must start at 0, got offsets[0]={o[0]}")
        if o.size > 1 and np.any(np.diff(o) < 0):
            raise ValueError("offsets must be non-decreasing; got a negative bag length")
        return np.diff(o)
    return jnp.diff(offsets)
