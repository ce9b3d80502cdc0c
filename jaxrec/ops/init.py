"""Initial values at memory speed, the same wherever they are drawn.

Tables and dense layers draw their uniform initial values from Philox4x32-10
addressed by element (:mod:`jaxrec.xla.philox`): a table's value at ``(row, col)``
depends only on its collection's key, its index in the collection (its
*stream*), ``row`` and ``col``. So a buffer of any rows and columns of any tables
(a whole group of stacked tables, or one device's shards under a plan) is drawn
directly, on its own device, with the values the whole table has anywhere else.

``implementation=None`` runs the C++ kernel on CPUs (multi-threaded, at memory
speed) and the XLA path elsewhere (an elementwise program on GPUs); both give the
same bits. Concrete keys run one compiled program per buffer shape; traced keys
(under ``jit`` or ``eval_shape``) run the same code in the traced program.

Why not ``jax.random.uniform``: threefry drew about 0.3 GB/s on two CPU cores, and
its values depend on the drawn shape, so a shard could not draw its own rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.core  # jax.core.Tracer: a submodule the type checker sees only when imported
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from ..xla.philox import key_words, piece_arrays, uniform_rows_xla
from .dispatch import Implementation, dispatch

DENSE_COLS = 1024  # a dense draw's values, laid out as rows of this many columns
SMALL_VALUES = 1 << 20  # eager buffers up to this many values are drawn in bucketed shapes


class TablePiece(NamedTuple):
    """Buffer rows ``[offset, offset + nrows)`` hold rows ``[row0, row0 + nrows)`` and
    columns ``[col0, col0 + width)`` of stream ``stream``, uniform in ``[lo, hi)``
    (buffer columns past ``width`` stay zero)."""

    offset: int
    nrows: int
    stream: int
    row0: int
    col0: int
    width: int
    lo: float
    hi: float


def uniform_rows(
    key: jax.Array,
    pieces: Sequence[TablePiece],
    rows: int,
    cols: int,
    dtype,
    *,
    implementation: Implementation = None,
) -> jax.Array:
    """A ``[rows, cols]`` buffer of ``dtype`` drawn as ``pieces`` say; uncovered rows
    and columns are zero. ``key``: a JAX key (concrete or traced) or ``uint32[2]``."""
    ints, floats = piece_arrays(pieces, rows)
    words = key_words(key)
    aligned = all(p.col0 % 4 == 0 for p in pieces)
    if isinstance(words, jax.core.Tracer):
        return draw_rows(
            words,
            ints,
            floats,
            rows=rows,
            cols=cols,
            dtype=dtype,
            implementation=implementation,
            aligned=aligned,
        )
    dtype = jnp.dtype(dtype)
    if 0 < rows * cols <= SMALL_VALUES:  # small: shapes bucketed, a few programs serve all
        bucket = 1 << (rows - 1).bit_length()
        ints, floats = _padded(ints, floats, bucket, 1 << (len(ints) - 1).bit_length())
        out = _draw_rows_jit(
            words,
            ints,
            floats,
            rows=bucket,
            cols=cols,
            dtype=dtype,
            implementation=implementation,
            aligned=aligned,
        )
        return jax.device_put(np.asarray(out)[:rows])  # cut on the host: no program
    return _draw_rows_jit(
        words,
        ints,
        floats,
        rows=rows,
        cols=cols,
        dtype=dtype,
        implementation=implementation,
        aligned=aligned,
    )


def _padded(ints: np.ndarray, floats: np.ndarray, rows: int, n: int) -> tuple[np.ndarray, ...]:
    """Piece arrays padded to ``n`` pieces with empty ones at ``rows`` (they cover nothing)."""
    pad = np.zeros((n - len(ints), 6), np.int32)
    pad[:, 0] = rows
    return (
        np.concatenate([ints, pad]),
        np.concatenate([floats, np.zeros((n - len(ints), 2), np.float32)]),
    )


def draw_rows(
    words: jax.Array,
    ints: ArrayLike,
    floats: ArrayLike,
    *,
    rows: int,
    cols: int,
    dtype,
    implementation: Implementation = None,
    aligned: bool = False,
) -> jax.Array:
    """:func:`uniform_rows` on arrays (``jaxrec.xla.philox.piece_arrays``' layout), for
    use inside traced programs such as one device's part of a ``shard_map``.
    ``aligned``: every piece's ``col0`` is a multiple of 4 (a faster XLA program)."""
    xla = functools.partial(_xla_jit, aligned=aligned)
    return dispatch(
        "uniform_rows",
        implementation,
        xla,
        words,
        ints,
        floats,
        rows=rows,
        cols=cols,
        dtype=jnp.dtype(dtype),
    )


# Jitted so that a shape traced once is not traced again (each trace of the XLA path
# costs tens of ms; a model's build traces its draws twice, in eval_shape and jit).
_xla_jit = jax.jit(uniform_rows_xla, static_argnames=("rows", "cols", "dtype", "aligned"))
_draw_rows_jit = jax.jit(
    draw_rows, static_argnames=("rows", "cols", "dtype", "implementation", "aligned")
)


def uniform(key: jax.Array, shape: Sequence[int], lo: float, hi: float, dtype) -> jax.Array:
    """``shape`` values uniform in ``[lo, hi)`` (dense layers): value ``e`` of the
    flattened array is element ``(e // DENSE_COLS, e % DENSE_COLS)`` of stream 0, so
    layers of every size share a few compiled programs (:func:`uniform_rows` buckets
    small buffers) and a draw is the same eager, traced or in any other shape's program."""
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if n == 0:
        return jnp.zeros(shape, dtype)
    rows = -(-n // DENSE_COLS)
    piece = TablePiece(0, rows, 0, 0, 0, DENSE_COLS, lo, hi)
    flat = uniform_rows(key, [piece], rows, DENSE_COLS, jnp.float32)
    if isinstance(flat, jax.core.Tracer):
        return flat.reshape(-1)[:n].reshape(shape).astype(dtype)
    # Cut on the host: an eager slice or reshape would compile a program per shape.
    return jax.device_put(np.asarray(flat).reshape(-1)[:n].reshape(shape).astype(dtype))


def host_pieces(pieces: Sequence[Sequence[TablePiece]], rows: int) -> tuple[np.ndarray, ...]:
    """Per-rank piece arrays stacked: ``(ints int32[N, P, 6], floats float32[N, P, 2])``
    with every rank padded to the most pieces (padding pieces cover nothing)."""
    arrays = [piece_arrays(p, rows) for p in pieces]
    most = max(len(i) for i, _ in arrays)
    padded = [_padded(i, f, rows, most) for i, f in arrays]
    return np.stack([i for i, _ in padded]), np.stack([f for _, f in padded])
