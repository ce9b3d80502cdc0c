"""Uniform initial values drawn in fixed-size chunks: one compiled program for any shape.

Eager JAX compiles a program per distinct shape, so a model with hundreds of
tables (or layers) of distinct sizes spent its build compiling random draws.
Here every draw is cut into chunks of :data:`CHUNK` values: chunk ``c`` of draw
``(key, sub)`` is ``uniform(fold_in(fold_in(key, sub), c), (CHUNK,), lo, hi)``.
Concrete keys run batches of chunks through one compiled program and the host
cuts and stacks them (no compile per shape); traced keys (under ``jit`` or
``eval_shape``) and draws too large for the host run the same chunks in a program
of their own. Either way the values are the same.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

CHUNK = 1 << 14  # values per chunk
BATCH = 64  # chunks per call of the host path's program
HOST_LIMIT = 1 << 26  # values: larger draws are assembled on device


@dataclasses.dataclass(frozen=True)
class Draw:
    """``shape`` values uniform in ``[lo, hi)`` from ``key`` (a typed key) and ``sub``."""

    key: jax.Array
    sub: int
    shape: tuple[int, ...]
    lo: float
    hi: float

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def chunks(self) -> int:
        return -(-self.size // CHUNK)


def uniform(key: jax.Array, shape: Sequence[int], lo: float, hi: float, dtype) -> jax.Array:
    """One draw (see the module docstring): ``shape`` values uniform in ``[lo, hi)``."""
    return stacked([Draw(key, 0, tuple(shape), lo, hi)], dtype)


def stacked(draws: Sequence[Draw], dtype) -> jax.Array:
    """The draws' values concatenated along axis 0 (all shapes share their trailing dims)."""
    total = sum(d.size for d in draws)
    if total == 0:  # no chunk to draw (a zero-sized layer)
        shape = (sum(d.shape[0] for d in draws), *draws[0].shape[1:])
        return jnp.zeros(shape, dtype)
    traced = any(isinstance(d.key, jax.core.Tracer) for d in draws)
    if traced or total > HOST_LIMIT:
        return _on_device(draws, jnp.dtype(dtype))
    # device_put, not jnp.asarray: that stages the array through a program per shape.
    return jax.device_put(_on_host(draws).astype(jnp.dtype(dtype)))


def _chunk(key, sub, c, lo, hi):
    key = jax.random.fold_in(jax.random.fold_in(key, sub), c)
    return jax.random.uniform(key, (CHUNK,), jnp.float32, lo, hi)


@functools.partial(jax.jit, static_argnames="impl")
def _batch(key_data, sub, c, lo, hi, impl):
    keys = jax.random.wrap_key_data(key_data, impl=impl)
    return jax.vmap(_chunk)(keys, sub, c, lo, hi)


def _on_host(draws: Sequence[Draw]) -> np.ndarray:
    impl = jax.random.key_impl(draws[0].key)
    chunks = np.asarray([d.chunks for d in draws])
    owner = np.repeat(np.arange(len(draws)), chunks)  # the draw of each chunk
    n = len(owner)
    pad = -n % BATCH  # every call has BATCH chunks: one shape, one compile
    owner = np.concatenate([owner, np.full(pad, owner[-1])])
    first = np.cumsum(chunks) - chunks
    c = (np.arange(n + pad) - first[owner]).astype(np.int32)
    data = {id(d.key): np.asarray(jax.random.key_data(d.key)) for d in draws}  # shared keys once
    keys = np.stack([data[id(d.key)] for d in draws])[owner]
    sub = np.asarray([d.sub for d in draws], np.int32)[owner]
    lo = np.asarray([d.lo for d in draws], np.float32)[owner]
    hi = np.asarray([d.hi for d in draws], np.float32)[owner]
    calls = [
        _batch(*(x[i : i + BATCH] for x in (keys, sub, c, lo, hi)), impl=impl)
        for i in range(0, n + pad, BATCH)
    ]  # all dispatched before the first is read
    out = np.concatenate([np.asarray(x) for x in calls])
    pieces = [
        out[f : f + d.chunks].reshape(-1)[: d.size].reshape(d.shape)
        for f, d in zip(first.tolist(), draws, strict=True)
    ]
    return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]


def _on_device(draws: Sequence[Draw], dtype) -> jax.Array:
    pieces = []
    for d in draws:
        c = jnp.arange(d.chunks, dtype=jnp.int32)
        # lax.map in batches bounds the temporaries (random bits) of a huge table.
        values = jax.lax.map(
            lambda c, d=d: _chunk(d.key, d.sub, c, d.lo, d.hi), c, batch_size=min(d.chunks, BATCH)
        )
        pieces.append(values.reshape(-1)[: d.size].reshape(d.shape).astype(dtype))
    return jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]
