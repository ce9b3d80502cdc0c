"""The CPU's in-place move (``jaxrec_cache_move``) against numpy: evicted slots to
their host rows, then host rows into the filled slots; column pieces, row-wise
fields and padding."""

import functools

import jax
import numpy as np
import pytest

from jaxrec import cpu
from jaxrec.cache import mover

pytestmark = pytest.mark.skipif(not cpu.available(), reason=str(cpu.unavailable_reason()))


def test_move_matches_numpy():
    rng = np.random.default_rng(0)
    host_w = rng.random((50, 12), np.float32)  # a column piece: host columns 3..8
    host_m = rng.random(50).astype(np.float32)  # a row-wise field
    buf_w = rng.random((20, 8), np.float32)  # slots padded to 8 columns
    buf_m = rng.random(20).astype(np.float32)
    n = 8
    evict_pos = np.full((2, n), -1, np.int32)
    fill_pos = np.full((2, n), -1, np.int32)
    evict_rows = np.zeros((2, n), np.int64)
    fill_rows = np.zeros((2, n), np.int64)
    ep, er = np.array([2, 7, 11]), np.array([40, 3, 17])
    fp, fr = np.array([2, 5, 7, 11, 19]), np.array([9, 40, 0, 49, 22])  # 40: evicted, then read
    for j in range(2):
        evict_pos[j, :3], evict_rows[j, :3] = ep, er
        fill_pos[j, :5], fill_rows[j, :5] = fp, fr
    want_hw, want_hm = host_w.copy(), host_m.copy()
    want_hw[er, 3:8], want_hm[er] = buf_w[ep, :5], buf_m[ep]
    want_bw, want_bm = buf_w.copy(), buf_m.copy()
    want_bw[fp, :5], want_bm[fp] = want_hw[fr, 3:8], want_hm[fr]

    attrs = (
        (0, host_w.ctypes.data, 50, host_w.strides[0], 3 * 4, 5 * 4),
        (1, host_m.ctypes.data, 50, 4, 0, 4),
    )
    move = jax.jit(functools.partial(mover._move_inplace, attrs), donate_argnums=0)
    bufs = [jax.numpy.asarray(buf_w), jax.numpy.asarray(buf_m)]
    rows = (evict_rows.view(np.int32), fill_rows.view(np.int32))  # int64 as int32 pairs
    (bw, bm), done = move(bufs, evict_pos, fill_pos, *rows)
    jax.block_until_ready(done)
    np.testing.assert_array_equal(host_w, want_hw)
    np.testing.assert_array_equal(host_m, want_hm)
    np.testing.assert_array_equal(np.asarray(bw), want_bw)
    np.testing.assert_array_equal(np.asarray(bm), want_bm)


def test_row_outside_the_host_table_is_refused():
    host = np.zeros((10, 4), np.float32)
    attrs = ((0, host.ctypes.data, 10, host.strides[0], 0, 16),)
    move = jax.jit(functools.partial(mover._move_inplace, attrs))
    pos = np.array([[1]], np.int32)
    rows = np.array([[10]], np.int64).view(np.int32)  # one past the end
    with pytest.raises(Exception, match="filled row outside the table"):
        out, done = move(
            [jax.numpy.zeros((4, 4))],
            np.array([[-1]], np.int32),
            pos,
            np.zeros((1, 2), np.int32),
            rows,
        )
        jax.block_until_ready(done)
    assert not host.any()
