"""A RowCache with its slot maps on the device: refusals change no table."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from cache_cases import CACHED, build, cached_twin, local_batch, loss_fn, optimizer

import jaxrec as jr
from jaxrec import cache as jc
from jaxrec import optim, train


def test_a_batch_over_a_set_changes_no_table():
    """61 distinct rows of ``big`` (60 slots in two sets of 30) do not fit: the error
    names the table and the fix, and neither ``big`` nor ``mean`` (whose rows fit) has
    changed; the cache goes on working."""
    opt = optimizer(optim.sgd(0.1))
    graphdef, state = build(opt)
    params = {t: jc.CacheParams(load_factor=0.3) for t in CACHED}
    g2, s2, cache = cached_twin(opt, graphdef, state, params, slot_maps="device")
    step = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn), cache)
    rng = np.random.default_rng(0)
    s2, _, _ = step(s2, local_batch(rng))
    before = {t: cache.cached(t) for t in CACHED}
    counts = {t: np.asarray(cache._maps.states[t].stamps) for t in CACHED}
    keys, n = ["a", "b", "m", "s"], 61
    big = jr.KeyedJaggedTensor.from_lengths_sync(
        keys, list(range(n)) + [7, 9, 0], [n, 1, 1, 1], capacities={k: 64 for k in keys}
    )
    with pytest.raises(jc.CacheTooSmallError, match=r"'big'.*30 slots of one.*2 sets.*load_factor"):
        step(s2, (big, np.zeros(1, np.float32)))
    for t in CACHED:
        for x, y in zip(before[t], cache.cached(t), strict=True):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(counts[t], np.asarray(cache._maps.states[t].stamps))
    s2, loss, _ = step(s2, local_batch(rng))
    assert np.isfinite(float(loss))


def test_prepared_ids_stay_on_the_device():
    """The batch's values come back as device arrays of slots: the host never holds
    the rewritten ids."""
    opt = optimizer(optim.sgd(0.1))
    graphdef, state = build(opt)
    params = {t: jc.CacheParams(load_factor=0.5) for t in CACHED}
    _, _, cache = cached_twin(opt, graphdef, state, params)
    kjt, _ = local_batch(np.random.default_rng(3))
    p = cache.prepare((kjt, np.zeros(1, np.float32)))
    values = p.batch[0].values()
    assert isinstance(values, jnp.ndarray) and not isinstance(values, np.ndarray)
    got = np.asarray(values)
    slots = {t: cache.cached(t) for t in CACHED}
    lengths = np.asarray(kjt.lengths()).reshape(4, -1).sum(1)
    starts = kjt.capacity_offsets()
    for k, table in zip(["a", "b", "m"], ["big", "big", "mean"], strict=True):
        i = kjt.keys().index(k)
        ids = np.asarray(kjt.values())[starts[i] : starts[i] + lengths[i]]
        out = got[starts[i] : starts[i] + lengths[i]]
        where = dict(zip(slots[table][1].tolist(), slots[table][0].tolist(), strict=True))
        assert out.tolist() == [where[x] for x in ids.tolist()]


def test_moves_cross_as_a_padded_prefix_off_the_cpu(monkeypatch):
    """Off the CPU only a bucket-sized prefix of the packed moves is copied back; the
    moves are the same as the whole array's."""
    from jaxrec.cache import device_maps

    packed = jnp.arange(4 * 5000, dtype=jnp.int32).reshape(4, 5000)
    whole = np.asarray(packed)
    monkeypatch.setattr(device_maps, "_on_cpu", lambda x: False)
    sizes = []
    monkeypatch.setattr(device_maps, "_slice", lambda p, k: sizes.append(k) or p[:, :k])
    for n in (0, 7, 300, 5000):
        np.testing.assert_array_equal(device_maps._prefix(packed, n), whole[:, :n])
    assert sizes == [256, 256, 384, 5000]  # bucket_capacity sizes, capped at the array


def test_64_bit_ids_past_int32_stay_out_of_range():
    """int64 host ids beyond int32 are not wrapped into a cached table's rows: they
    stay out of range (the device's bounds check then treats them as without a cache)."""
    from jaxrec.cache import device_maps

    ids = np.array([5, -3, 2**32 + 5, 2**31, -(2**32) + 7], np.int64)
    got = device_maps._int32(ids)
    assert got.dtype == np.int32
    assert got.tolist() == [5, -1, 2**31 - 1, 2**31 - 1, -1]


def test_default_slot_maps_by_platform():
    """One process: the device's maps off the CPU, the host's on it (faster there);
    a bad name is refused."""
    from jaxrec.cache import row_cache

    assert row_cache._on_host(None, {"cpu"})
    assert not row_cache._on_host(None, {"gpu"})
    assert not row_cache._on_host("device", {"cpu"})
    assert row_cache._on_host("host", {"gpu"})
    with pytest.raises(ValueError, match="slot_maps must be"):
        row_cache._on_host("hbm", {"gpu"})
