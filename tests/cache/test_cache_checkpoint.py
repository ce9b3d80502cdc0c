"""Checkpoints of a cached model hold the logical tables (the host tier with the
cached rows flushed into it): they restore into a cold cache or into the
all-device-memory model, and training goes on exactly."""

import cache_cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cache_cases import (
    CACHED,
    assert_tables_equal,
    build,
    cached_twin,
    dense,
    local_batch,
    logical_tables,
    loss_fn,
    optimizer,
)

from jaxrec import cache as jc
from jaxrec import checkpoint as ckpt
from jaxrec import optim, train


def test_save_restore_cold_cache_and_all_device(tmp_path):
    opt = optimizer(optim.rowwise_adagrad(0.3))
    params = {t: jc.CacheParams(algorithm="lfu", load_factor=0.3) for t in CACHED}
    graphdef, state = build(opt)
    fresh = jax.tree.map(jnp.copy, state)
    g2, s2, cache = cached_twin(opt, graphdef, state, params)
    step = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn), cache)
    full = train.make_train_step(graphdef, opt, loss_fn)
    rng = np.random.default_rng(3)
    first, then = [local_batch(rng) for _ in range(6)], [local_batch(rng) for _ in range(4)]
    for b in first:
        s2, _, _ = step(s2, b)
    mgr = ckpt.CheckpointManager(tmp_path, async_save=True)
    s2 = cache.save(mgr, 6, s2)
    assert mgr.all_steps() == [6]
    spec = mgr._meta(6)["spec"]["tables"]
    assert spec["ebc.embedding_bags.big"]["shape"] == [200, 8]  # the logical table
    for b in then:
        s2, _, _ = step(s2, b)
    s2 = cache.flush(s2)
    want = logical_tables(g2, opt, s2, cache)

    # a cold cache in a new model: the same tables after the same steps
    g3, s3, cache3 = cached_twin(opt, graphdef, fresh, params)
    s3 = cache3.restore(mgr, s3)
    assert all(len(cache3.cached(t)[0]) == 0 for t in cache3.tables)
    step3 = jc.CachedTrainStep(train.make_train_step(g3, opt, loss_fn), cache3)
    for b in then:
        s3, _, _ = step3(s3, b)
    s3 = cache3.flush(s3)
    got = logical_tables(g3, opt, s3, cache3)
    assert_tables_equal(got, want)
    for a, b in zip(dense(s2), dense(s3), strict=True):
        np.testing.assert_array_equal(a, b)

    # the same checkpoint into the all-device model: same tables after the same steps
    s4 = mgr.restore(graphdef, opt, jax.tree.map(jnp.copy, fresh))
    for b in then:
        s4, _, _ = full(s4, b)
    got = logical_tables(graphdef, opt, s4)
    assert_tables_equal(got, want)
    mgr.close()


def test_all_device_checkpoint_into_cache(tmp_path):
    """A checkpoint of the all-device model restores into the cached model's host tables."""
    opt = optimizer(optim.adam(0.05))
    params = {t: jc.CacheParams(load_factor=0.5) for t in CACHED}
    graphdef, state = build(opt)
    full = train.make_train_step(graphdef, opt, loss_fn)
    g2, s2, cache = cached_twin(opt, graphdef, jax.tree.map(jnp.copy, state), params)
    rng = np.random.default_rng(4)
    for _ in range(3):
        state, _, _ = full(state, local_batch(rng))
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(3, graphdef, opt, state)
        s2 = cache.restore(mgr, s2)
    want = logical_tables(graphdef, opt, state)
    got = logical_tables(g2, opt, s2, cache)
    assert_tables_equal(got, want)


def test_refused_restore_keeps_the_cache(tmp_path):
    """A restore refused before reading (no such step) and a resume with nothing to
    resume leave the cached rows in place: the flushed tables are still the trained ones."""
    opt = optimizer(optim.sgd(0.3))
    params = {t: jc.CacheParams(load_factor=0.5) for t in CACHED}
    graphdef, state = build(opt)
    g2, s2, cache = cached_twin(opt, graphdef, state, params)
    step = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn), cache)
    rng = np.random.default_rng(8)
    for _ in range(3):
        s2, _, _ = step(s2, local_batch(rng))
    mgr = ckpt.CheckpointManager(tmp_path, async_save=False)
    s2, resumed = cache.resume(mgr, s2)
    assert resumed == 0
    with pytest.raises(FileNotFoundError):
        cache.restore(mgr, s2, step=99)
    s2 = cache.flush(s2)
    got = logical_tables(g2, opt, s2, cache)
    full = train.make_train_step(graphdef, opt, loss_fn)
    rng = np.random.default_rng(8)
    for _ in range(3):
        state, _, _ = full(state, local_batch(rng))
    want = logical_tables(graphdef, opt, state)
    assert_tables_equal(got, want)


def test_a_cache_is_not_checkpointed_without_its_host_table(tmp_path):
    """The manager called directly on a cached model (its slot tables are not the tables)
    refuses to save or restore, naming the tables and RowCache.save; RowCache's own
    save and restore go through."""
    opt = optimizer(optim.sgd(0.1))
    params = {t: jc.CacheParams(load_factor=0.3) for t in CACHED}
    graphdef, state = build(opt)
    g2, s2, cache = cached_twin(opt, graphdef, state, params)
    assert {c.name: c.cached_rows for c in jc.cached_configs(cache_cases.configs(), params)} == {
        "big": 200,
        "mean": 120,
        "small": None,
    }
    mgr = ckpt.CheckpointManager(tmp_path, async_save=False)
    with pytest.raises(ValueError, match=r"\['big', 'mean'\] are device caches.*RowCache.save"):
        mgr.save(1, g2, opt, s2)
    assert mgr.all_steps() == []
    s2 = cache.save(mgr, 1, s2)
    with pytest.raises(ValueError, match="device caches"):
        mgr.restore(g2, opt, s2)
    s2 = cache.restore(mgr, s2)
