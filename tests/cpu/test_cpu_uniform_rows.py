"""The C++ initialiser ``jaxrec_uniform_rows`` against the XLA reference, bit for bit.

The reference runs jitted (one compilation per shape, ~1 s each: they are most of
this file's time). Asymmetric bounds are checked against the reference and against
the definition in numpy (``mid + half * (2u - 1)`` summed in float64, where the
product is exact, so XLA's multiply-add contraction under jit cannot change it).
Half-precision buffers are the reference's float32 values cast
(``uniform_rows_xla`` draws float32, then casts), checked once against the
reference's own cast.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrec import cpu
from jaxrec.cpu.init import uniform_rows_cpu
from jaxrec.cpu.loader import build_info
from jaxrec.ops.backends import CPU
from jaxrec.xla.philox import philox4x32, uniform_rows_xla

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"{cpu.unavailable_reason()}")

KEY = jnp.array([0x12345678, 0x9ABCDEF0], jnp.uint32)
_XLA = jax.jit(uniform_rows_xla, static_argnames=("rows", "cols", "dtype"))
_CPU = jax.jit(uniform_rows_cpu, static_argnames=("rows", "cols", "dtype"))


def _f16() -> list:
    return [jnp.float16] if cpu.available() and build_info().get("uniform_rows_f16") else []


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _check(ints, floats, rows, cols, *, key=KEY, dtypes=(jnp.bfloat16,), jit=True):
    """The kernel's float32 buffer, after checking it and its ``dtypes`` buffers
    against the reference's bits."""
    ints, floats = jnp.asarray(ints, jnp.int32), jnp.asarray(floats, jnp.float32)
    want = _XLA(key, ints, floats, rows=rows, cols=cols, dtype=jnp.float32)
    out = None
    for dtype in (jnp.float32, *dtypes):
        got = (_CPU if jit else uniform_rows_cpu)(
            key, ints, floats, rows=rows, cols=cols, dtype=dtype
        )
        assert got.shape == (rows, cols) and got.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(_bits(got), _bits(want.astype(dtype)), err_msg=str(dtype))
        out = np.asarray(got) if out is None else out
    return out


def _pieces(rows, cols):
    """Five tables' pieces with a gap, column shards, padding and asymmetric bounds."""
    half = max(1, cols // 2)
    ints = [
        # offset, nrows, stream, row0, col0, width
        (0, 37, 0, 0, 0, cols),
        (37, 0, 9, 0, 0, cols),  # padding between pieces
        (41, 50, 3, 1000, 5, max(1, cols - 3)),  # rows 37..40: a gap; col0 % 4 == 1
        (91, 20, 7, 2**31 - 10, 2, half),  # row0 + i wraps past 2^31, as int32 does
        (111, rows - 111, 1, 77, 4 * 3 + 3, cols),
        (rows, 0, 0, 0, 0, 0),  # padding at the end
        (rows, 0, 0, 0, 0, 0),
    ]
    floats = [(0.0, 0.01), (0, 0), (0.5, 0.25), (-3.0, 2.0), (1e-3, 0.5), (0, 0), (0, 0)]
    return ints, floats


@pytest.mark.parametrize("cols", [1, 3, 12, 16, 20, 64, 128])
def test_matches_xla_bit_for_bit(cols):
    rows = 150
    ints, floats = _pieces(rows, cols)
    got = _check(ints, floats, rows, cols, dtypes=[jnp.bfloat16, *_f16()], jit=cols % 2 == 0)
    assert not got[37:41].any()  # the gap
    if cols > 1:
        assert not got[91:111, max(1, cols // 2) :].any()  # past the shard's width
    assert np.all((got[:37] >= -0.01) & (got[:37] < 0.01)) and got[:37].std() > 0.003


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_as_the_reference_casts(dtype):
    if dtype == jnp.float16 and not _f16():
        with pytest.raises(NotImplementedError):
            uniform_rows_cpu(
                KEY, *map(jnp.asarray, _pieces(150, 20)), rows=150, cols=20, dtype=dtype
            )
        return
    ints, floats = map(jnp.asarray, _pieces(150, 20))
    want = _XLA(KEY, ints, floats, rows=150, cols=20, dtype=dtype)
    got = _CPU(KEY, ints, floats, rows=150, cols=20, dtype=dtype)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_wide_rows_and_ragged_shards():
    # Rows of more than a block of counters (4 * 256 words), shards cut anywhere.
    ints = [(0, 3, 2, 5, 0, 1500), (3, 4, 2, 8, 1, 1100), (7, 2, 5, 0, 1027, 900)]
    floats = [(0.0, 0.1), (0.25, 1.0), (-1.0, 0.5)]
    _check(ints, floats, 10, 1500)


def test_large_buffer_on_threads():
    # 150k x 64 float32 (38 MB): split over the threads, huge pages, streamed stores.
    rows, cols = 150_000, 64
    ints = [(0, 100_000, 0, 0, 0, 64), (100_000, 49_999, 1, 0, 0, 64)]
    floats = [(0.0, 0.05), (0.0, 0.001)]
    got = _check(ints, floats, rows, cols, key=jnp.array([7, 8], jnp.uint32))
    assert np.abs(got[100_000:]).max() < 0.001 and not got[-1].any()


def test_tiny_and_empty_buffers():
    _check([(0, 1, 4, 3, 2, 1)], [(2.0, 1.0)], 1, 1, jit=False)
    for rows, cols in ((0, 8), (5, 0)):
        ints = jnp.array([(rows, 0, 0, 0, 0, 0)], jnp.int32)
        got = uniform_rows_cpu(KEY, ints, jnp.zeros((1, 2)), rows=rows, cols=cols, dtype="float32")
        assert got.shape == (rows, cols)


def test_pieces_past_their_bounds_are_clamped_as_in_the_reference():
    # A negative offset; nrows past the next piece or the buffer; width past cols;
    # a piece starting past the end.
    ints = [
        (-5, 12, 7, 0, 0, 16),
        (3, 500, 0, 0, 0, 99),
        (30, 5, 1, 0, 0, 16),
        (38, 90, 2, 4, 1, 16),
        (70, 9, 3, 0, 0, 8),
    ]
    got = _check(ints, [(0.0, 1.0)] * 5, 60, 16)
    assert not got[35:38].any()  # piece 2 ends at 35, piece 3 starts at 38


def test_asymmetric_bounds_as_defined():
    # mid != 0 and a product inexact in float32: float32(mid + half * x) with the sum
    # in float64 (the product exact there), whether or not a compiler contracts it;
    # the u of each element from the reference (mid = half = 0.5 gives u exactly).
    ints = jnp.array([(0, 20, 0, 3, 0, 16), (20, 20, 1, 0, 1, 15)], jnp.int32)
    floats = np.array([(1e-3, 7.5), (0.3, 0.7)], np.float32)
    u = np.asarray(_XLA(KEY, ints, jnp.full((2, 2), 0.5), rows=40, cols=16, dtype=jnp.float32))
    mid, half = np.repeat(floats[:, :1], 20, 0), np.repeat(floats[:, 1:], 20, 0)
    x = (u * np.float32(2) - np.float32(1)).astype(np.float64)  # exact
    want = (half.astype(np.float64) * x + mid.astype(np.float64)).astype(np.float32)
    want[20:, 15:] = 0
    jitted = _XLA(KEY, ints, jnp.asarray(floats), rows=40, cols=16, dtype=jnp.float32)
    np.testing.assert_array_equal(_bits(jitted), _bits(want))
    for dtype in (jnp.float32, jnp.bfloat16, *_f16()):
        got = uniform_rows_cpu(KEY, ints, jnp.asarray(floats), rows=40, cols=16, dtype=dtype)
        np.testing.assert_array_equal(_bits(got), _bits(want.astype(dtype)))


def test_matches_known_answers():
    # mid = half = 0.5 gives u itself, exactly: the top 23 bits of each word.
    def words(ints, rows, cols, key):
        floats = jnp.array([(0.5, 0.5)], jnp.float32)
        got = uniform_rows_cpu(
            key, jnp.array(ints, jnp.int32), floats, rows=rows, cols=cols, dtype=jnp.float32
        )
        return (np.asarray(got).astype(np.float64) * 2**23).astype(np.uint32)

    # Random123's kat_vectors, Philox4x32-10, counter 0 and key 0.
    got = words([(0, 1, 0, 0, 0, 4)], 1, 4, jnp.zeros(2, jnp.uint32))
    want = np.array([0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8], np.uint32) >> 9
    np.testing.assert_array_equal(got[0], want)
    # Counter (row, 0, col // 4, stream) for row 1234 + i, words 6.. of stream 9.
    got = words([(0, 3, 9, 1234, 6, 10)], 3, 10, KEY)
    rows = jnp.arange(1234, 1237, dtype=jnp.uint32)[:, None]
    q = jnp.arange(1, 5, dtype=jnp.uint32)[None, :]
    w = jax.jit(lambda r, q, k: philox4x32((r, 0, q, 9), (k[0], k[1])))(rows, q, KEY)
    want = np.stack([np.asarray(x) for x in w], axis=-1).reshape(3, 16)[:, 2:12] >> 9
    np.testing.assert_array_equal(got, want)


def test_bad_arguments():
    ints, floats = jnp.zeros((1, 6), jnp.int32), jnp.zeros((1, 2), jnp.float32)
    with pytest.raises(NotImplementedError):
        uniform_rows_cpu(KEY, ints, floats, rows=4, cols=4, dtype=jnp.float64)
    with pytest.raises(TypeError, match="ints must be int32"):
        uniform_rows_cpu(KEY, np.zeros((1, 6), np.int64), floats, rows=4, cols=4, dtype=jnp.float32)
    with pytest.raises(TypeError, match="floats must be float32"):
        uniform_rows_cpu(KEY, ints, jnp.zeros((1, 3)), rows=4, cols=4, dtype=jnp.float32)
    with pytest.raises(TypeError, match="key must be uint32"):
        uniform_rows_cpu(KEY[:1], ints, floats, rows=4, cols=4, dtype=jnp.float32)
    with pytest.raises(TypeError, match="describe 1 and 2 pieces"):
        uniform_rows_cpu(KEY, ints, jnp.zeros((2, 2)), rows=4, cols=4, dtype=jnp.float32)
    unsorted = jnp.array([[2, 1, 0, 0, 0, 4], [0, 1, 0, 0, 0, 4]], jnp.int32)
    with pytest.raises(Exception, match="sorted by offset; piece 1"):
        uniform_rows_cpu(KEY, unsorted, jnp.zeros((2, 2)), rows=4, cols=4, dtype=jnp.float32)


def test_the_cpu_backend_serves_uniform_rows():
    assert CPU["uniform_rows"] is uniform_rows_cpu
