"""The slot maps against an independent model of LRU and LFU, and their errors."""

import dataclasses

import numpy as np
import pytest
from cache_cases import CACHED, build, cached_twin, configs, local_batch, loss_fn, optimizer

import jaxrec as jr
from jaxrec import cache as jc
from jaxrec import optim, train
from jaxrec.cache import row_cache
from jaxrec.cache.slots import NATIVE, SlotMap


def run(m: SlotMap, ids: np.ndarray, scan: bool = True):
    """One batch through the map: ``(Assignment, slots of ids)``; ``scan``: the hits'
    slots written by the plan's pass where it can (C++), as ``RowCache`` does."""
    out = np.empty_like(ids)
    plan = m.plan([ids], "t", [out] if scan else None)
    a = m.assign(plan)
    if plan.scanned:
        m.finish(ids, out)
    else:
        m.touch(ids, out, 0)
    return a, out


@pytest.mark.parametrize("native", [False, True] if NATIVE else [False])
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_replacement_policy(algorithm, native):
    """Random batches through a 40-slot cache of 300 rows: slots and rows stay a
    bijection, every row of a batch is cached, and each evicted row was (LRU) used no
    later / (LFU) looked up no more often than every row kept outside the batch."""
    rng = np.random.default_rng(0)
    m = SlotMap(300, 40, jc.CacheAlgorithm(algorithm), native=native)
    last, count, evictions = {}, np.zeros(300, np.int64), 0
    for clock in range(1, 200):
        ids = np.minimum(rng.zipf(1.2, int(rng.integers(1, 60))) - 1, 299).astype(np.int32)
        if len(np.unique(ids)) > 40:
            continue
        a, out = run(m, ids)
        np.testing.assert_array_equal(m.row_of_slot[out], ids)
        batch = set(ids.tolist())
        np.add.at(count, ids, 1)
        kept = {int(r) for r in m.row_of_slot if r >= 0} - batch
        for r in a.evict_rows.tolist():
            assert r not in batch and r not in kept
            if algorithm == "lru":
                assert all(last[r] <= last[k] for k in kept)
            else:
                assert all(count[r] <= count[k] for k in kept)
        evictions += len(a.evict_rows)
        for r in batch:
            last[r] = clock
        cached = np.flatnonzero(m.slot_of_row >= 0)
        np.testing.assert_array_equal(np.sort(m.row_of_slot[m.row_of_slot >= 0]), cached)
        np.testing.assert_array_equal(m.row_of_slot[m.slot_of_row[cached]], cached)
        assert batch <= set(cached.tolist())
    assert evictions > 100


@pytest.mark.skipif(not NATIVE, reason="the C++ extension (jaxrec.cpu._kernels) is not built")
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_native_passes_equal_numpy(algorithm):
    """The C++ passes (planned with the slots written in the scan, or remapped after)
    give the numpy passes' slots, moves, stamps and counts (ties in the victims' keys
    occur: LFU counts and LRU stamps repeat)."""
    rng = np.random.default_rng(1)
    maps = [SlotMap(5000, 700, jc.CacheAlgorithm(algorithm), native=n) for n in (True, True, False)]
    for _ in range(60):
        ids = np.minimum(rng.zipf(1.1, 900) - 1, 4999).astype(np.int32)
        (xa, oa), (xc, oc), (xb, ob) = (
            run(m, ids, scan) for m, scan in zip(maps, (True, False, False), strict=True)
        )
        for x, o in ((xa, oa), (xc, oc)):
            np.testing.assert_array_equal(o, ob)
            for f in ("fill_slots", "evict_slots", "evict_rows"):
                np.testing.assert_array_equal(getattr(x, f), getattr(xb, f))
            assert set(x.fill_rows.tolist()) == set(xb.fill_rows.tolist()) and x.hits == xb.hits
    for m in maps[:2]:
        for f in ("slot_of_row", "row_of_slot", "last_used", "counts"):
            np.testing.assert_array_equal(getattr(m, f), getattr(maps[2], f))
        assert m._seen is None  # the C++ passes keep the batch in bits: no 8 bytes a slot


@pytest.mark.skipif(not NATIVE, reason="the C++ extension (jaxrec.cpu._kernels) is not built")
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_native_victims_with_keys_far_apart(algorithm):
    """Victims whose keys lie far past the smallest (LFU: one rare row among rows looked
    up thousands of times; LRU: stamps far apart), where the C++ pass leaves its
    histogram for nth_element: the numpy map's slots still."""
    maps = [SlotMap(400, 100, jc.CacheAlgorithm(algorithm), native=n) for n in (True, False)]
    hot = np.repeat(np.arange(99, dtype=np.int32), 1700)  # counts past the C++ histogram
    batches = [hot] * 40 + [np.array([99], np.int32)]  # row 99: count 1, last used
    batches += [np.arange(100 + 50 * i, 150 + 50 * i, dtype=np.int32) for i in range(5)]
    for ids in batches:
        (xa, oa), (xb, ob) = (run(m, ids) for m in maps)
        np.testing.assert_array_equal(oa, ob)
        for f in ("fill_slots", "evict_slots", "evict_rows"):
            np.testing.assert_array_equal(getattr(xa, f), getattr(xb, f))
    assert maps[0].counts is None or maps[0].counts[:99].min() > 1 << 16


@pytest.mark.skipif(not NATIVE, reason="the C++ extension (jaxrec.cpu._kernels) is not built")
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_native_victim_order_survives_other_passes(algorithm):
    """The C++ victim orders (LRU's log, LFU's logs by count) after batches planned in
    numpy (int64 ids: the plan's marks from numpy), whole batches in numpy (the order
    rebuilt from the stamps and counts), a plan that was never assigned, and ``clear``:
    still the numpy map's slots and stamps. Small slots make the logs compact often."""
    rng = np.random.default_rng(2)
    alg = jc.CacheAlgorithm(algorithm)
    a, b = SlotMap(3000, 300, alg), SlotMap(3000, 300, alg, native=False)
    for i in range(120):
        ids = np.minimum(rng.zipf(1.1, 400) - 1, 2999).astype(np.int32)
        if i == 60:
            a.clear(), b.clear()
        if i % 7 == 3:
            other = np.flatnonzero(a.slot_of_row >= 0)[::3].astype(np.int32)
            a.plan([other], "t")  # never assigned: its marks must not stamp the next batch
        a.native = i % 5 != 1  # a batch wholly in numpy
        xa, oa = run(a, ids.astype(np.int64) if i % 5 == 2 else ids)
        xb, ob = run(b, ids)
        np.testing.assert_array_equal(oa, ob)
        for f in ("fill_slots", "evict_slots", "evict_rows"):
            np.testing.assert_array_equal(getattr(xa, f), getattr(xb, f))
        np.testing.assert_array_equal(a.last_used, b.last_used)
    assert a.lru_ends[1] > 0 or algorithm == "lfu"  # the log was in use at the end


@pytest.mark.parametrize("threaded", [False, True])
def test_cache_too_small_leaves_state_valid(monkeypatch, threaded):
    """Planned one table after another or on threads (every table's plan ends before
    the error is raised): no map changes."""
    monkeypatch.setattr(row_cache, "_THREAD_IDS", 0 if threaded else 1 << 40)
    opt = optimizer(optim.sgd(0.1))
    graphdef, state = build(opt)
    params = {t: jc.CacheParams(load_factor=0.3) for t in CACHED}
    g2, s2, cache = cached_twin(opt, graphdef, state, params, slot_maps="host")
    step = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn), cache)
    rng = np.random.default_rng(0)
    s2, _, _ = step(s2, local_batch(rng))
    before = [m.slot_of_row.copy() for t in cache.tables.values() for m in t.maps]
    keys, n = ["a", "b", "m", "s"], 61  # 61 distinct rows of "big" > its 60 slots
    big = jr.KeyedJaggedTensor.from_lengths_sync(
        keys, list(range(n)) + [0, 0, 0], [n, 1, 1, 1], capacities={k: 64 for k in keys}
    )
    with pytest.raises(jc.CacheTooSmallError, match=r"'big'.*61 distinct rows.*60 slots.*0\.305"):
        step(s2, (big, np.zeros(1, np.float32)))
    after = [m.slot_of_row for t in cache.tables.values() for m in t.maps]
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)
    s2, loss, _ = step(s2, local_batch(rng))  # the cache still works
    assert np.isfinite(float(loss))


def test_out_of_range_ids_as_without_cache():
    """Ids outside a cached table stay outside its slot table: the bounds check
    (WARNING: they count zero) gives the all-device model's loss."""
    opt = optimizer(optim.sgd(0.1))
    graphdef, state = build(opt)
    params = {t: jc.CacheParams(load_factor=0.5) for t in CACHED}
    g2, s2, cache = cached_twin(opt, graphdef, state, params)
    kjt, y = local_batch(np.random.default_rng(5))
    values = np.asarray(kjt.values()).copy()
    values[0], values[1] = 999, -3  # feature "a" (table "big") has bags in sample 0
    bad = jr.KeyedJaggedTensor(
        kjt.keys(), values, lengths=kjt.lengths(), capacities=kjt.capacity_per_key()
    )
    assert int(np.asarray(kjt.lengths())[0]) >= 2
    _, want, _ = train.make_train_step(graphdef, opt, loss_fn)(state, (bad, y))
    _, got, _ = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn), cache)(s2, (bad, y))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_host_tables_checked():
    """A host table of another dim, with the wrong optimizer's fields, or a cached
    table whose feature another table reads: each refused with the reason."""
    opt = optimizer(optim.rowwise_adagrad(0.1))
    params = {t: jc.CacheParams(load_factor=0.5) for t in CACHED}
    g2, s2 = build(opt, jc.cached_configs(configs(), params))
    big = configs()[0]
    ok = jc.HostTable.create(big, opt.for_table("big"))
    wide = dataclasses.replace(big, embedding_dim=16)
    cases = {
        "dim 8": {"big": jc.HostTable.create(wide, opt.for_table("big"))},
        "its optimizer needs": {"big": jc.HostTable.create(big, optim.sgd(0.1))},
        "does not have": {"nope": ok},
    }
    for message, hosts in cases.items():
        with pytest.raises(ValueError, match=message):
            jc.RowCache(g2, opt, s2, hosts, jc.CacheParams())
    shared = [
        dataclasses.replace(c, feature_names=["a"]) if c.name == "small" else c
        for c in jc.cached_configs(configs(), params)
    ]
    g3, s3 = build(opt, shared)
    with pytest.raises(ValueError, match=r"feature 'a' of cached table 'big' is also read by"):
        jc.RowCache(g3, opt, s3, {"big": ok}, jc.CacheParams())


def test_cache_slots_is_the_exact_ceiling():
    """One slot count for the planner and the cache: ceil of the exact product (0.1 *
    200 is 20.000000000000004 in floats), at least 1."""
    from fractions import Fraction

    from jaxrec.distributed.planner.storage import cache_slots as planner_slots

    for rows in (1, 7, 200, 201, 999_999, 10**9 + 7):
        for lf in ("0.05", "0.1", "0.2", "0.3", "1"):
            exact = -(-Fraction(lf) * rows // 1)
            assert jc.slots_per_shard(rows, 1, jc.CacheParams(load_factor=float(lf))) == max(
                1, exact
            )
            assert planner_slots(rows, float(lf)) == max(1, exact)


def test_too_small_names_a_load_factor_that_fits():
    # 502 of 5000 rows need 0.1004 of them: "0.1" would still be too small
    m = SlotMap(5000, 500, jc.CacheAlgorithm.LRU)
    with pytest.raises(jc.CacheTooSmallError, match=r"502 distinct rows.*at least 0\.101 "):
        m.plan([np.arange(502, dtype=np.int32)], "t")
