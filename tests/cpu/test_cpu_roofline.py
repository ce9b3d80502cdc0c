"""The bench's ceilings (``jaxrec.cpu.read_bandwidth`` / ``gather_rows``) against numpy."""

import numpy as np
import pytest

from jaxrec import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"{cpu.unavailable_reason()}")


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [0, 5, 1000, 100_003])
def test_read_bandwidth_sums_every_value(n, threads):
    data = np.random.default_rng(n).random(n, dtype=np.float32)
    seconds, total = cpu.read_bandwidth(data, threads)
    assert seconds >= 0
    np.testing.assert_allclose(total, data.sum(dtype=np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("ahead", [0, 1, 16])
@pytest.mark.parametrize("d", [1, 16, 64, 128, 300])  # tails, one block, several blocks
def test_gather_rows_sums_the_rows(d, ahead, threads):
    rng = np.random.default_rng(d)
    table = rng.standard_normal((500, d)).astype(np.float32)
    ids = rng.integers(0, 500, 2001).astype(np.int32)
    ids[:50] = 7  # a row read many times
    seconds, sums = cpu.gather_rows(table, ids, threads, ahead)
    assert seconds >= 0 and sums.shape == (d,)
    want = table[ids].sum(0, dtype=np.float64)
    np.testing.assert_allclose(sums, want, rtol=1e-4, atol=1e-3)


def test_gather_rows_empty_and_bad_ids():
    table = np.ones((4, 16), np.float32)
    _, sums = cpu.gather_rows(table, np.zeros(0, np.int32), 2)
    np.testing.assert_array_equal(sums, np.zeros(16, np.float32))
    with pytest.raises(ValueError, match="outside"):
        cpu.gather_rows(table, np.array([0, 4], np.int32), 1)
    with pytest.raises(ValueError, match="table must be"):
        cpu.gather_rows(np.ones(4, np.float32), np.zeros(1, np.int32), 1)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("d", "per"), [(1, 1), (16, 1), (64, 20), (37, 3), (300, 2)])
def test_gather_pool_rows_sums_each_run(d, per, threads):
    rng = np.random.default_rng(d + per)
    table = rng.standard_normal((300, d)).astype(np.float32)
    ids = rng.integers(0, 300, 40 * per).astype(np.int32)
    out = np.full((40, d), np.nan, np.float32)
    seconds = cpu.gather_pool_rows(table, ids, out, threads)
    assert seconds >= 0
    want = table[ids].reshape(40, per, d).sum(1, dtype=np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="outside"):
        cpu.gather_pool_rows(table, np.full(40 * per, 300, np.int32), out, threads)
    with pytest.raises(ValueError, match="G dividing"):
        cpu.gather_pool_rows(table, ids[:-1], out, threads)
