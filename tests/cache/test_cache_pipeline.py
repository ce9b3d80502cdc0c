"""Prefetching (the pipeline plans batch i + depth while step i runs) gives the same
states and losses as preparing each batch right before its step."""

import functools
import itertools

import jax
import numpy as np
import pytest
from cache_cases import (
    CACHED,
    assert_tables_equal,
    build,
    cached_twin,
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
from jaxrec.cache import mover, row_cache

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


@pytest.mark.parametrize("depth,inplace", [(1, False), (3, False), (3, True)])
def test_prefetched_equals_unprefetched(depth, inplace):
    """On both move paths: staged (rows an in-flight batch evicts are patched at load
    time) and in place (the CPU's: moves read the host in program order)."""
    opt = optimizer(optim.rowwise_adagrad(0.3))
    params = {t: jc.CacheParams(load_factor=0.3) for t in CACHED}
    graphdef, state = build(opt)
    rng = np.random.default_rng(2)
    batches = [local_batch(rng) for _ in range(10)]
    runs = []
    for prefetch in (False, True):
        g2, s2, cache = cached_twin(
            opt, graphdef, state, params, move_paths=jc.MovePaths(inplace=inplace)
        )
        assert cache._mover.inplace == inplace
        step = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn, donate=False), cache)
        losses = []
        if prefetch:
            pipe = train.TrainPipeline(step, s2, to_device=jc.prefetching(cache), depth=depth)
            it = iter(batches)
            while True:
                try:
                    losses.append(float(pipe.progress(it)[0]))
                except StopIteration:
                    break
            s2 = pipe.state
        else:
            for b in batches:
                s2, loss, _ = step(s2, b)
                losses.append(float(loss))
        s2 = cache.flush(s2)
        runs.append((losses, logical_tables(g2, opt, s2, cache), cache.stats))
    (l0, t0, st0), (l1, t1, st1) = runs
    assert l0 == l1
    assert_tables_equal(t1, t0)
    for t in CACHED:
        late = st1[t].late
        st0[t].late = st1[t].late = 0
        assert st0[t] == st1[t] and st0[t].evictions > 0
        # staged: rows evicted by a batch in flight were copied when loaded
        assert late > 0 if not inplace else late == 0


def test_loads_follow_prepares():
    """A prepared batch loaded out of order is refused (its slots assume the earlier
    batches' loads)."""
    opt = optimizer(optim.sgd(0.1))
    graphdef, state = build(opt)
    params = {t: jc.CacheParams(load_factor=0.5) for t in CACHED}
    g2, s2, cache = cached_twin(opt, graphdef, state, params)
    rng = np.random.default_rng(0)
    first, second = cache.prepare(local_batch(rng)), cache.prepare(local_batch(rng))
    with pytest.raises(ValueError, match="in the order they were prepared"):
        cache.load(s2, second)
    cache.load(s2, first)


def test_evaluation_through_load_batch():
    """An eval step on a cached model gives the all-device model's outputs once the
    batch is loaded; the same state is then trained on exactly."""
    opt = optimizer(optim.rowwise_adagrad(0.3))
    params = {t: jc.CacheParams(load_factor=0.5) for t in CACHED}
    graphdef, state = build(opt)
    g2, s2, cache = cached_twin(opt, graphdef, state, params)
    evaluate = train.make_eval_step(graphdef, lambda m, b: m(b[0]))
    evaluate2 = train.make_eval_step(g2, lambda m, b: m(b[0]))
    step = train.make_train_step(graphdef, opt, loss_fn)
    cstep = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn), cache)
    rng = np.random.default_rng(6)
    for _ in range(3):
        b, e = local_batch(rng), local_batch(rng)
        state, _, _ = step(state, b)
        s2, _, _ = cstep(s2, b)
        s2, e2 = cache.load_batch(s2, e)
        np.testing.assert_array_equal(np.asarray(evaluate2(s2, e2)), np.asarray(evaluate(state, e)))


@pytest.mark.parametrize("sharded", [False, True])
def test_pinned_host_staging(sharded):
    """Rows staged in pinned host memory (the default off the CPU, forced here) move as
    the direct path moves them: the cached model stays equal to the all-device one."""
    if sharded and len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (a GPU machine with one runs the unsharded case)")
    opt = optimizer(optim.rowwise_adagrad(0.3))
    lf = {"big": 0.4, "mean": 0.2} if sharded else {"big": 0.3, "mean": 0.3}
    params = {t: jc.CacheParams(load_factor=lf[t]) for t in CACHED}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",)) if sharded else None
    plan = None
    if sharded:
        gens = {"big": d.row_wise(), "mean": d.table_wise(1), "small": d.table_wise(0)}
        plan = logical_plan(gens, mesh, params)
    graphdef, state = build(opt, plan=None if plan is None else fused(plan), mesh=mesh)
    paths = jc.MovePaths(pinned=True)  # (not in place: that is for CPU memory)
    g2, s2, cache = cached_twin(opt, graphdef, state, params, plan, mesh, move_paths=paths)
    assert cache._mover.staging is not None
    step = train.make_train_step(graphdef, opt, loss_fn)
    cstep = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn), cache)
    rng = np.random.default_rng(7)
    for _ in range(6):
        local = [local_batch(rng, 4) for _ in range(2)] if sharded else local_batch(rng)
        b = d.shard_batch(local, mesh) if sharded else local
        state, loss, _ = step(state, b)
        p = cache.prepare(local)
        if sharded:
            p = p._replace(batch=d.shard_batch(p.batch, mesh))
        s2, loss2, _ = cstep(s2, p)
        np.testing.assert_array_equal(np.asarray(loss2), np.asarray(loss))
    if sharded:  # each device stages and moves its own rows: nothing crosses devices
        m = cache._mover
        p = cache.prepare(local_batch(rng, 4))
        s2 = cache.load(s2, p)
        n = p.staged.n
        for i, staging in enumerate(m.staging):  # a lane of n rows per device
            assert staging.memory_kind == "pinned_host"
            assert staging.shard_shape((2 * n,)) == (n,) and sorted(p.staged.fill_pos[i]) == [0, 1]
        # the compiled gather of evicted rows: n rows out of each device, no collectives
        arrays = [b.array for b in m.buffers]
        pos = [
            m._global(i, {j: np.zeros(n, np.int32) for j in range(2)}, n, m.chunks[i])
            for i in range(len(arrays))
        ]
        gather = functools.partial(mover._gather, tuple(m.specs))
        out = jax.jit(gather, out_shardings=m.staging).lower(arrays, pos).compile()
        assert not any(c in out.as_text() for c in COLLECTIVES)
        rows = sum(n * a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in arrays)
        got = out.memory_analysis().output_size_in_bytes  # (+ the output tuple's pointers)
        assert rows <= got <= rows + 16 * len(arrays), (got, rows)
    s2 = cache.flush(s2)
    want, got = logical_tables(graphdef, opt, state), logical_tables(g2, opt, s2, cache)
    assert_tables_equal(got, want)  # (a batch loaded and not trained on changes no row)
    assert all(cache.stats[t].evictions > 0 for t in CACHED)


def _inflight_reference(cache):
    """Per table, how many unsaved batches evict each row, from the unsaved list."""
    out = {k: np.zeros_like(v, np.int64) for k, v in cache._inflight.counts.items()}
    for batch in cache._inflight.batches:
        for k, rows in batch.rows.items():
            np.add.at(out[k], rows, 1)
    return out


def _staged_sgd_cache(load_factor):
    """``(state, RowCache)`` of the cached twin on the staged path, SGD."""
    opt = optimizer(optim.sgd(0.1))
    graphdef, state = build(opt)
    params = {t: jc.CacheParams(load_factor=load_factor) for t in CACHED}
    _, s2, cache = cached_twin(opt, graphdef, state, params, move_paths=jc.MovePaths(inplace=False))
    return s2, cache


def test_inflight_counts_follow_unsaved_batches():
    """Staged path: the per-row counts that find late fills equal the unsaved batches'
    evictions after every prepare, load and write-back, and are all zero once flushed."""
    s2, cache = _staged_sgd_cache(0.3)
    rng = np.random.default_rng(4)
    queue = []

    def check():
        ref = _inflight_reference(cache)
        for k, v in cache._inflight.counts.items():
            np.testing.assert_array_equal(v, ref[k])

    for _ in range(9):
        queue.append(cache.prepare(local_batch(rng)))
        check()
        if len(queue) == 3:  # three batches ahead, as a depth-3 pipeline
            s2 = cache.load(s2, queue.pop(0))
            check()
    assert max(int(v.max()) for v in cache._inflight.counts.values()) >= 1
    for p in queue:
        s2 = cache.load(s2, p)
    s2 = cache.flush(s2)
    assert all(not v.any() for v in cache._inflight.counts.values())
    assert not cache._inflight.batches


def test_too_many_unloaded_batches_are_refused():
    """The staged path counts unsaved evictions in a byte per row: the 256th prepared
    batch not loaded is refused, before anything changes, and loading goes on."""
    s2, cache = _staged_sgd_cache(0.5)
    rng = np.random.default_rng(5)
    one = local_batch(rng, 1)
    prepared = [cache.prepare(one) for _ in range(255)]
    with pytest.raises(ValueError, match="255 prepared batches are not loaded"):
        cache.prepare(one)
    for p in prepared[:2]:
        s2 = cache.load(s2, p)
    cache.write_back()
    prepared.append(cache.prepare(one))  # room again
    assert prepared[-1].serial == 256


def test_planning_threads_give_the_same_batches(monkeypatch):
    """Tables planned on threads (the default for large batches) or one after another:
    the same slots, moves and states."""
    monkeypatch.setattr(row_cache, "_THREAD_IDS", 0)  # threads for these small batches
    calls = []
    each = row_cache.RowCache._each

    def counted(self, fn, n, keys):
        calls.append(n)
        return each(self, fn, n, keys)

    monkeypatch.setattr(row_cache.RowCache, "_each", counted)
    opt = optimizer(optim.rowwise_adagrad(0.3))
    params = {t: jc.CacheParams(load_factor=0.3) for t in CACHED}
    graphdef, state = build(opt)
    rng = np.random.default_rng(8)
    batches = [local_batch(rng) for _ in range(6)]
    runs = []
    for threads in (1, 4):  # (host slot maps: the device's plan every table at once)
        g2, s2, cache = cached_twin(opt, graphdef, state, params)
        cache = jc.RowCache(
            g2,
            opt,
            s2,
            {t.name: t.host for t in cache.tables.values()},
            params,
            threads=threads,
            slot_maps="host",
        )
        assert cache._threads == (1 if threads == 1 else len(CACHED))
        step = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn, donate=False), cache)
        ids = []
        for b in batches:
            p = cache.prepare(b)
            ids.append(np.asarray(jax.tree.leaves(p.batch[0])[0]))
            s2, _, _ = step(s2, p)
        runs.append((ids, logical_tables(g2, opt, cache.flush(s2), cache)))
    assert set(calls) == {1, len(CACHED)}
    (i0, t0), (i1, t1) = runs
    for a, b in zip(i0, i1, strict=True):
        np.testing.assert_array_equal(a, b)
    assert_tables_equal(t1, t0)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX's: this child runs no JAX
def test_planning_threads_work_in_a_forked_child():
    """A child forked after the parent started planning threads (a data loader's worker)
    gets a pool of its own: the parent's threads do not exist there."""
    import os

    assert row_cache._pool(2).submit(lambda: 1).result(timeout=30) == 1
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the pool runs a task, and never return
        code = 1
        try:
            code = 0 if row_cache._pool(2).submit(lambda: 2).result(timeout=20) == 2 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _twin(sparse=None, move_paths=None):
    """The all-device model and its cached twin (load factor 0.3): ``(opt, graphdef,
    state, g2, s2, cache)``."""
    opt = optimizer(sparse or optim.rowwise_adagrad(0.3))
    params = {t: jc.CacheParams(load_factor=0.3) for t in CACHED}
    graphdef, state = build(opt)
    return (opt, graphdef, state, *cached_twin(opt, graphdef, state, params, move_paths=move_paths))


def _stopped_pipeline(inplace, monkeypatch, steps, batches, depth=2):
    """A prefetching pipeline over ``batches`` after ``steps`` steps (not exhausted: it
    holds batches prefetched), and the all-device model trained on the same steps."""
    monkeypatch.setattr(row_cache, "_FLUSH_ROWS", 7)  # a flush copies in several chunks
    opt, graphdef, state, g2, s2, cache = _twin(move_paths=jc.MovePaths(inplace=inplace))
    assert cache._mover.inplace == inplace
    cstep = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn, donate=False), cache)
    pipe = train.TrainPipeline(cstep, s2, to_device=jc.prefetching(cache), depth=depth)
    it = iter(batches)
    for _ in range(steps):
        pipe.progress(it)
    ref = train.make_train_step(graphdef, opt, loss_fn)
    for b in batches[:steps]:
        state, _, _ = ref(state, b)
    return opt, (graphdef, state, ref), (g2, cache, cstep), pipe, it


@pytest.mark.parametrize("inplace", [False, True])
def test_flush_while_batches_are_prefetched(monkeypatch, inplace):
    """A checkpoint's flush mid-pipeline (batches prepared, not loaded: the maps are
    ahead of the device) writes the model's current rows, and the pipeline goes on
    exactly with its state (the flush reads it, donates nothing)."""
    rng = np.random.default_rng(11)
    batches = [local_batch(rng) for _ in range(12)]
    opt, (g, state, ref), (g2, cache, _), pipe, it = _stopped_pipeline(
        inplace, monkeypatch, 5, batches, depth=3
    )
    assert cache._prepared > cache._loaded  # the pipeline holds batches not loaded
    assert cache.flush(pipe.state) is pipe.state  # only read: the pipeline goes on with it
    assert_tables_equal(logical_tables(g2, opt, pipe.state, cache), logical_tables(g, opt, state))
    while True:
        try:
            pipe.progress(it)
        except StopIteration:
            break
    for b in batches[5:]:
        state, _, _ = ref(state, b)
    s2 = cache.flush(pipe.state)
    assert_tables_equal(logical_tables(g2, opt, s2, cache), logical_tables(g, opt, state))
    assert all(cache.stats[t].evictions > 0 for t in CACHED)


@pytest.mark.parametrize("inplace", [False, True])
def test_discard_prefetched_then_train_on(monkeypatch, inplace):
    """A pipeline closed over an endless loader leaves prefetched batches planned but not
    loaded: the next load is refused, naming the fix; discard_prefetched loads their
    rows (they are not trained on) and training goes on exactly."""
    rng = np.random.default_rng(12)
    batches = [local_batch(rng) for _ in range(12)]
    opt, (g, state, ref), (g2, cache, cstep), pipe, _ = _stopped_pipeline(
        inplace, monkeypatch, 5, batches
    )
    pipe.close()
    s2, more = pipe.state, [local_batch(rng) for _ in range(3)]
    with pytest.raises(ValueError, match=r"discard_prefetched\(state\)"):
        cstep(s2, more[0])
    stale = cache.prepare(more[0])  # planned, then discarded with the pipeline's
    s2 = cache.discard_prefetched(s2)
    assert cache._prepared == cache._loaded
    with pytest.raises(ValueError, match="loaded already"):
        cache.load(s2, stale)
    for b in more:
        s2, _, _ = cstep(s2, b)
        state, _, _ = ref(state, b)
    s2 = cache.flush(s2)
    assert_tables_equal(logical_tables(g2, opt, s2, cache), logical_tables(g, opt, state))


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_step_failing_after_its_load_hands_back_the_state(pipelined):
    """A batch the step cannot trace fails after its rows were loaded, and the load took
    the state given: ``err.state`` (and ``pipeline.state``) is the loaded state, and
    training goes on exactly as the all-device model's, which the batch leaves as it was."""
    opt, graphdef, state, g2, s2, cache = _twin()
    cstep = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn), cache)
    ref = train.make_train_step(graphdef, opt, loss_fn)
    rng = np.random.default_rng(13)
    batches = [local_batch(rng) for _ in range(8)]
    kjt, y = batches[3]
    batches[3] = (kjt, y[:5])  # labels of the wrong length: the loss does not trace
    for i, b in enumerate(batches):
        if i == 3:
            with pytest.raises(TypeError):
                ref(state, b)
        else:
            state, _, _ = ref(state, b)
    errors = 0
    if pipelined:
        pipe = train.TrainPipeline(cstep, s2, to_device=jc.prefetching(cache), depth=2)
        it = iter(batches)
        while True:
            try:
                pipe.progress(it)
            except StopIteration:
                break
            except TypeError as e:
                assert e.state is pipe.state and "err.state" in str(e.__notes__)
                errors += 1
        s2 = pipe.state
    else:
        for b in batches:
            try:
                s2, _, _ = cstep(s2, b)
            except TypeError as e:
                s2, errors = e.state, errors + 1
    assert errors == 1
    s2 = cache.flush(s2)
    assert_tables_equal(logical_tables(g2, opt, s2, cache), logical_tables(graphdef, opt, state))


def test_a_failure_that_consumed_the_loaded_state_says_to_restore():
    """A failure after the load that also consumed the loaded state's buffers (a run
    failing on the device; not reproducible on the CPU, whose errors surface later)
    hands back no state: the note says to restore from a checkpoint."""
    *_, s2, _ = _twin()
    kept = jc.step.handed_back(ValueError("a step failed"), s2)
    assert kept.state is s2 and "go on with err.state" in str(kept.__notes__)
    assert str(kept) == "a step failed"
    jax.tree.leaves(s2.params)[0].delete()  # as a failed run's donation leaves it
    lost = jc.step.handed_back(ValueError("a step failed"), s2)
    assert not hasattr(lost, "state") and "restore the cache" in str(lost.__notes__)


def test_evaluation_between_pipeline_segments():
    """An endless loader cut into segments (itertools.islice): each segment's pipeline
    ends with nothing prefetched past it, so evaluation loads its batches and training
    goes on with the next segment, nothing discarded: equal to the all-device model."""
    opt, graphdef, state, g2, s2, cache = _twin()
    cstep = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn, donate=False), cache)
    ref = train.make_train_step(graphdef, opt, loss_fn)
    evaluate = train.make_eval_step(graphdef, lambda m, b: m(b[0]))
    evaluate2 = train.make_eval_step(g2, lambda m, b: m(b[0]))
    rng = np.random.default_rng(14)

    def endless():
        while True:
            yield local_batch(rng)

    loader, trained = endless(), []
    pipe = train.TrainPipeline(cstep, s2, to_device=jc.prefetching(cache), depth=2)
    for _ in range(3):
        segment = itertools.islice(loader, 4)
        kept = []  # the batches this segment trains on, for the reference
        pipe_it = map(lambda b: kept.append(b) or b, segment)
        while True:
            try:
                pipe.progress(pipe_it)
            except StopIteration:
                break
        trained += kept
        for b in kept:
            state, _, _ = ref(state, b)
        assert cache._prepared == cache._loaded  # nothing prefetched past the segment
        e = local_batch(rng)
        pipe.state, e2 = cache.load_batch(pipe.state, e)
        np.testing.assert_array_equal(
            np.asarray(evaluate2(pipe.state, e2)), np.asarray(evaluate(state, e))
        )
    assert len(trained) == 12
    s2 = cache.flush(pipe.state)
    assert_tables_equal(logical_tables(g2, opt, s2, cache), logical_tables(graphdef, opt, state))


def test_discard_prefetched_hands_back_the_state_of_earlier_loads():
    """A load that fails during discard_prefetched after earlier ones took the caller's
    buffers: err.state holds those loads (valid), and the cache counts them loaded."""
    _, _, _, _, s2, cache = _twin(optim.sgd(0.1))
    rng = np.random.default_rng(15)
    cache.prepare(local_batch(rng))
    cache.prepare(local_batch(rng))
    del cache._unloaded[2]  # as if the second prepare had failed after planning
    with pytest.raises(RuntimeError, match="no move to load") as info:
        cache.discard_prefetched(s2)
    assert cache._loaded == 1 and "err.state" in str(info.value.__notes__)
    assert any(x.is_deleted() for x in jax.tree.leaves(s2))  # the first load took them
    assert not any(x.is_deleted() for x in jax.tree.leaves(info.value.state))
