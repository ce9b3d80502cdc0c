"""A cached model trains exactly as the all-device-memory model (tables, optimizer
rows, dense params, losses), for several optimizers, policies and plans."""

import jax
import numpy as np
import pytest
from cache_cases import (
    CACHED,
    assert_tables_equal,
    build,
    cached_twin,
    dense,
    fused,
    local_batch,
    logical_plan,
    logical_tables,
    loss_fn,
    optimizer,
)

from jaxrec import cache as jc
from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.cache import native

STEPS = 12
OPTS = {
    "sgd": lambda: optim.sgd(0.3),
    "rowwise_adagrad": lambda: optim.rowwise_adagrad(0.3),
    "adam": lambda: optim.adam(0.05),
}


def run_pair(opt, params, steps=STEPS, seed=0, numpy_only=False, slot_maps="device"):
    graphdef, state = build(opt)
    slot_maps = "host" if numpy_only else slot_maps
    g2, s2, cache = cached_twin(opt, graphdef, state, params, slot_maps=slot_maps)
    if numpy_only:  # the passes without the C++ extension
        for t in cache.tables.values():
            for m in t.maps:
                m.native = False
    step = train.make_train_step(graphdef, opt, loss_fn)
    cstep = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn), cache)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        b = local_batch(rng)
        state, loss, _ = step(state, b)
        s2, loss2, _ = cstep(s2, b)
        np.testing.assert_array_equal(np.asarray(loss), np.asarray(loss2))
    s2 = cache.flush(s2)
    return (graphdef, state), (g2, s2), cache


# each optimizer once, each policy at least once (the policy only picks which rows
# move; test_slots and test_sets check the policies against models of them); the slot
# maps on the device (the default), on the host with the C++ passes and with numpy
@pytest.mark.parametrize(
    "name,algorithm,maps",
    [
        ("sgd", "lru", "device"),
        ("rowwise_adagrad", "lfu", "device"),
        ("adam", "lru", "device"),
        ("rowwise_adagrad", "lru", "host"),
        ("rowwise_adagrad", "lfu", "numpy"),
    ],
)
def test_unsharded_exact(name, algorithm, maps, monkeypatch):
    numpy_only = maps == "numpy"
    if numpy_only:
        monkeypatch.setattr(native, "AVAILABLE", False)
    opt = optimizer(OPTS[name]())
    params = {t: jc.CacheParams(algorithm=algorithm, load_factor=0.3) for t in CACHED}
    where = "host" if maps == "host" else "device"
    (g, s), (g2, s2), cache = run_pair(opt, params, numpy_only=numpy_only, slot_maps=where)
    want = logical_tables(g, opt, s)
    got = logical_tables(g2, opt, s2, cache)
    assert_tables_equal(got, want)
    for a, b in zip(dense(s), dense(s2), strict=True):
        np.testing.assert_array_equal(a, b)
    for t in CACHED:  # the cache was too small to hold everything: rows went both ways
        assert cache.stats[t].evictions > 0 and 0 < cache.stats[t].hit_rate < 1


SHARDED = {  # name: (generators, devices)
    "row_wise": ({"big": d.row_wise(), "mean": d.table_wise(2), "small": d.row_wise()}, 4),
    "column_wise": (
        {"big": d.column_wise([1, 3]), "mean": d.row_wise([0, 3]), "small": d.table_wise(0)},
        4,
    ),
}


@pytest.mark.parametrize("layout", list(SHARDED))
def test_sharded_exact(layout):
    """Row-wise (each row shard its own cache), table-wise and column-wise (one slot per
    row, in both column pieces; row-wise Adagrad's state copied into each): exact."""
    gens, n = SHARDED[layout]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
    opt = optimizer(optim.rowwise_adagrad(0.3))
    params = {t: jc.CacheParams(load_factor=0.6) for t in CACHED}
    plan = logical_plan(gens, mesh, params)
    graphdef, state = build(opt, plan=fused(plan), mesh=mesh)
    g2, s2, cache = cached_twin(opt, graphdef, state, params, plan, mesh)
    step = train.make_train_step(graphdef, opt, loss_fn)
    cstep = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn), cache)
    rng = np.random.default_rng(1)
    for _ in range(8):
        local = [local_batch(rng, 3) for _ in range(n)]
        state, loss, _ = step(state, d.shard_batch(local, mesh))
        p = cache.prepare(local)
        s2, loss2, _ = cstep(s2, p._replace(batch=d.shard_batch(p.batch, mesh)))
        np.testing.assert_array_equal(np.asarray(loss), np.asarray(loss2))
    s2 = cache.flush(s2)
    want, got = logical_tables(graphdef, opt, state), logical_tables(g2, opt, s2, cache)
    assert_tables_equal(got, want)
    assert all(cache.stats[t].evictions > 0 for t in CACHED)
    if layout == "row_wise":
        assert len(cache.tables["big"].maps) == 4  # a cache per row shard


def test_model_parallel_refuses_a_cached_plan():
    """A plan with fused_uvm_caching tables is for device_plan, not the logical model."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    params = {"big": jc.CacheParams(load_factor=0.5)}
    plan = logical_plan(SHARDED["row_wise"][0], mesh, params)
    with pytest.raises(ValueError, match=r"\['ebc.big'\].*jaxrec.cache.device_plan"):
        build(optimizer(optim.sgd(0.1)), plan=plan, mesh=mesh)


@pytest.mark.parametrize("inplace", [False, True])
def test_a_refused_host_field_leaves_the_cache_valid(inplace):
    """A host field replaced rather than filled in place (another shape; in place, a
    non-contiguous copy) is refused with its name, before anything changes:
    - when a batch is prepared: put it back and the same step trains exactly;
    - when a prefetched batch is loaded: put it back and load it again (exact), or go
      on with the next batch, whose load loads the refused one's rows first (that
      batch is then not trained on, here nor in the all-device model)."""
    opt = optimizer(optim.rowwise_adagrad(0.3))
    params = {t: jc.CacheParams(load_factor=0.3) for t in CACHED}
    graphdef, state = build(opt)
    g2, s2, cache = cached_twin(
        opt, graphdef, state, params, move_paths=jc.MovePaths(inplace=inplace)
    )
    assert cache._mover.inplace == inplace
    step = train.make_train_step(graphdef, opt, loss_fn)
    cstep = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn), cache)
    rng = np.random.default_rng(3)
    fields = cache.tables["big"].host.fields
    good = fields["weight"]
    bad = np.asfortranarray(good) if inplace else good[:, :-1].copy()
    for i in range(10):
        b = raw = local_batch(rng)
        if i == 3:  # refused when prepared
            fields["weight"] = bad
            with pytest.raises(ValueError, match="'big' field 'weight'"):
                cstep(s2, b)
            fields["weight"] = good
        if i in (5, 7):  # refused when loaded (prefetched before the swap)
            p = cache.prepare(b)
            fields["weight"] = bad
            with pytest.raises(ValueError, match="'big' field 'weight'"):
                cstep(s2, p)
            fields["weight"] = good
            if i == 7:  # go on without it: its rows are loaded by the next step
                continue
            b = p
        state, loss, _ = step(state, raw)
        s2, loss2, _ = cstep(s2, b)
        np.testing.assert_array_equal(np.asarray(loss), np.asarray(loss2))
    s2 = cache.flush(s2)
    assert_tables_equal(logical_tables(g2, opt, s2, cache), logical_tables(graphdef, opt, state))
