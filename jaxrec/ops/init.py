"""Uniform initial values drawn in fixed-size chunks: one compiled program for any shape.

Eager JAX compiles a program per distinct shape, so a model with hundreds of
tables (or layers) of distinct sizes spent its build compiling random draws.
Here every draw is cut into chunks of :data:`CHUNK` values: chunk ``c`` of draw
``(key, sub)`` is ``uniform(fold_in(fold_in(key, sub), c), (CHUNK,), lo, hi)``.
Concrete keys run batches of chunks through one compiled program and the host
cuts and stacks them (no compile per shape); tables too large for the host are
written on device, a batch of chunks at a time, into one donated buffer; traced
keys (under ``jit`` or ``eval_shape``) run the same chunks in the traced program.
Every way gives the same values.
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
DEVICE_BATCH = 256  # chunks per call when writing into a device buffer
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
    if traced:
        return _on_device(draws, jnp.dtype(dtype))
    if total > HOST_LIMIT:
        if all(len(d.shape) == 2 for d in draws):  # tables: written in place, chunk by chunk
            return _into_buffer(draws, jnp.dtype(dtype))
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
    rows = _chunk_rows(draws, BATCH)
    impl = jax.random.key_impl(draws[0].key)
    calls = [
        _batch(*(rows[k][i : i + BATCH] for k in ("key", "sub", "c", "lo", "hi")), impl=impl)
        for i in range(0, len(rows["c"]), BATCH)
    ]  # all dispatched before the first is read
    out = np.concatenate([np.asarray(x) for x in calls])
    pieces, first = [], 0
    for d in draws:
        pieces.append(out[first : first + d.chunks].reshape(-1)[: d.size].reshape(d.shape))
        first += d.chunks
    return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]


def _chunk_rows(draws: Sequence[Draw], batch: int) -> dict[str, np.ndarray]:
    """Per chunk: its draw's key data, ``sub``, chunk number and bounds, padded to a
    multiple of ``batch`` chunks (the padding repeats the last chunk: one shape)."""
    chunks = np.asarray([d.chunks for d in draws])
    owner = np.repeat(np.arange(len(draws)), chunks)  # the draw of each chunk
    owner = np.concatenate([owner, np.full(-len(owner) % batch, owner[-1])])
    first = np.cumsum(chunks) - chunks
    data = {id(d.key): np.asarray(jax.random.key_data(d.key)) for d in draws}  # shared keys once
    return {
        "owner": owner,
        "key": np.stack([data[id(d.key)] for d in draws])[owner],
        "sub": np.asarray([d.sub for d in draws], np.int32)[owner],
        "c": (np.arange(len(owner)) - first[owner]).astype(np.int32),
        "lo": np.asarray([d.lo for d in draws], np.float32)[owner],
        "hi": np.asarray([d.hi for d in draws], np.float32)[owner],
    }


def _into_buffer(draws: Sequence[Draw], dtype) -> jax.Array:
    """2-D draws stacked by rows, each batch of chunks written in place into one donated
    buffer: peak memory is the result plus one batch (concatenating whole draws would
    hold every value twice: 82 GB for a 41 GB group)."""
    dim = draws[0].shape[1]
    rows = _chunk_rows(draws, DEVICE_BATCH)
    n = sum(d.chunks for d in draws)
    row0 = np.cumsum([0] + [d.shape[0] for d in draws])[rows["owner"]]
    start = rows["c"].astype(np.int64) * CHUNK  # flat offset in its draw (may pass 2**31)
    sizes = np.asarray([d.size for d in draws], np.int64)[rows["owner"]]
    count = np.where(np.arange(len(start)) < n, np.minimum(CHUNK, sizes - start), 0)
    first_row = (row0 + start // dim).astype(np.int32)
    first_col = (start % dim).astype(np.int32)
    impl = jax.random.key_impl(draws[0].key)
    buf = jnp.zeros((sum(d.shape[0] for d in draws), dim), dtype)
    for i in range(0, len(start), DEVICE_BATCH):
        part = slice(i, i + DEVICE_BATCH)
        buf = _fill(
            buf, *(rows[k][part] for k in ("key", "sub", "c", "lo", "hi")),
            first_row[part], first_col[part], count[part].astype(np.int32), impl=impl,
        )  # fmt: skip
    return buf


@functools.partial(jax.jit, static_argnames="impl", donate_argnums=0)
def _fill(buf, key_data, sub, c, lo, hi, row, col, count, impl):
    vals = _batch(key_data, sub, c, lo, hi, impl=impl).astype(buf.dtype)  # [batch, CHUNK]
    j = jnp.arange(CHUNK, dtype=jnp.int32)[None, :]
    pos = col[:, None] + j  # from the chunk's first row (col < dim: no int32 overflow)
    r = jnp.where(j < count[:, None], row[:, None] + pos // buf.shape[1], buf.shape[0])
    at = (r.reshape(-1), (pos % buf.shape[1]).reshape(-1))
    return buf.at[at].set(vals.reshape(-1), mode="drop")


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
