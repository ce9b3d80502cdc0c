"""The C++ slot-map plan (``jaxrec_cache_plan_sets``) against ``plan_sets`` and the loop.

Every output is compared with ``plan_sets``' bit for bit (overflowing batches
included: their slots and moves too), and the state, slots and moves with the
plain-loop reference (``sets_reference.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sets_reference import ReferenceSets, random_batch

from jaxrec.cache import sets
from jaxrec.cpu import loader
from jaxrec.distributed.types import CacheAlgorithm


@pytest.fixture(autouse=True)
def _kernel():
    if not loader.has_target(sets.CPU_TARGET):
        pytest.skip(f"no {sets.CPU_TARGET}: {loader.unavailable_reason() or 'an older build'}")


def _programs(layout):
    xla = jax.jit(functools.partial(sets.plan_sets, layout))
    cpu = jax.jit(functools.partial(sets.plan_sets_cpu, layout))
    return xla, cpu


def _assert_same(a: sets.SetPlan, b: sets.SetPlan):
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def _check_reference(plan, ref, ids, valid):
    slots, fills, evicts, n_rows, overflow = ref.plan(ids.tolist(), valid.tolist())
    assert bool(plan.overflow) == overflow
    np.testing.assert_array_equal(np.asarray(plan.state.rows), ref.held)
    np.testing.assert_array_equal(np.asarray(plan.state.stamps), ref.stamp)
    np.testing.assert_array_equal(np.asarray(plan.state.counts), ref.counts)
    assert int(plan.state.clock) == ref.clock
    if overflow:
        return
    np.testing.assert_array_equal(np.asarray(plan.slots), slots)
    nf, ne = int(plan.n_fill), int(plan.n_evict)
    got = np.stack([plan.fill_slots, plan.fill_rows])[:, :nf].T.tolist()
    assert [tuple(f) for f in got] == fills
    got = np.stack([plan.evict_slots, plan.evict_rows])[:, :ne].T.tolist()
    assert [tuple(e) for e in got] == evicts
    assert int(plan.n_rows) == n_rows


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
@pytest.mark.parametrize(
    ("rows", "shards", "slots", "alpha", "n"),
    [
        (500, 1, 24, None, 29),  # one set, often over: overflowing plans compared too
        (500, 1, 24, 1.1, 40),
        (3000, 1, 300, 1.05, 96),
        (4001, 3, 130, 1.2, 96),
        (2000, 2, 97, None, 48),
        (300_000, 1, 2_200_000, 1.05, 64),  # sets far outnumber the misses: sorted
    ],
)
def test_steps_match_plan_sets_and_the_reference(algorithm, rows, shards, slots, alpha, n):
    layout = sets.set_layout(rows, shards, slots, CacheAlgorithm(algorithm))
    xla, cpu = _programs(layout)
    state = sets.empty_state(layout)
    ref = ReferenceSets(rows, shards, slots, layout.sets, algorithm == "lfu")
    rng = np.random.default_rng(rows + slots + n)
    done = 0
    for _ in range(8):
        ids, valid = random_batch(rng, rows, n, alpha)
        want = xla(state, jnp.asarray(ids), jnp.asarray(valid))
        got = cpu(state, jnp.asarray(ids), jnp.asarray(valid))
        _assert_same(got, want)
        if slots < 10_000:  # the loop is slow over millions of slots
            _check_reference(got, ref, ids, valid)
        done += not bool(got.overflow)
        state = got.state
    assert done >= 2


def test_wide_sets_and_repeated_ids():
    """Sets of 50 slots (a custom layout past 32 ways) and a batch of one hot row."""
    for algorithm in CacheAlgorithm:
        layout = sets.SetLayout(1000, 1000, 1, 100, 2, algorithm)
        xla, cpu = _programs(layout)
        state = sets.empty_state(layout)
        rng = np.random.default_rng(3)
        for step in range(6):
            ids = rng.integers(0, 1000, 64).astype(np.int32)
            if step == 3:
                ids[:] = 7
            valid = np.ones(64, bool)
            want = xla(state, jnp.asarray(ids), jnp.asarray(valid))
            got = cpu(state, jnp.asarray(ids), jnp.asarray(valid))
            _assert_same(got, want)
            state = got.state


def test_lfu_counts_saturate():
    layout = sets.set_layout(100, 1, 40, CacheAlgorithm.LFU)
    xla, cpu = _programs(layout)
    state = sets.empty_state(layout)
    counts = np.zeros(100, np.int32)
    counts[:10] = np.iinfo(np.int32).max - np.arange(10)
    state = state._replace(counts=jnp.asarray(counts))
    ids = jnp.asarray(np.repeat(np.arange(12, dtype=np.int32), 4))
    valid = jnp.ones(48, bool)
    want = xla(state, ids, valid)
    got = cpu(state, ids, valid)
    _assert_same(got, want)
    assert int(got.state.counts[0]) == np.iinfo(np.int32).max
    assert int(got.state.counts[11]) == 4


def test_overflow_in_place_leaves_the_state_as_given():
    """With the state donated (the kernel writes it in place), a refused batch returns it
    as it was: the hits' stamps put back."""
    layout = sets.set_layout(10_000, 1, 64, CacheAlgorithm.LFU)  # 2 sets of 32
    cpu = jax.jit(functools.partial(sets.plan_sets_cpu, layout), donate_argnums=0)
    xla = jax.jit(functools.partial(sets.plan_sets, layout))
    first = np.arange(0, 40, dtype=np.int32)
    state = cpu(sets.empty_state(layout), jnp.asarray(first), jnp.ones(40, bool)).state
    h = sets.set_hash_np(np.arange(10_000)) % layout.sets
    batch = np.concatenate([first[:20], np.flatnonzero(h == 0)[:33].astype(np.int32)])
    before = [np.asarray(a).copy() for a in state]
    want = xla(state, jnp.asarray(batch), jnp.ones(len(batch), bool))
    got = cpu(state, jnp.asarray(batch), jnp.ones(len(batch), bool))
    assert state.rows.is_deleted()  # the kernel had the buffers
    assert bool(got.overflow)
    for a, b in zip(got.state, before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    _assert_same(got, want)


def test_plan_under_jit_with_donation():
    """plan(): the C++ kernel on CPU (in place: no copy, no sort), plan_sets' results; the
    same program lowered for CUDA is plan_sets'; "xla" runs plan_sets."""
    layout = sets.set_layout(5000, 2, 400, CacheAlgorithm.LRU)
    program = jax.jit(functools.partial(sets.plan, layout), donate_argnums=0)
    xla = jax.jit(functools.partial(sets.plan_sets, layout))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 5000, 128).astype(np.int32))
    valid = jnp.ones(128, bool)
    hlo = program.lower(sets.empty_state(layout), ids, valid).compile().as_text()
    assert sets.CPU_TARGET in hlo and " sort(" not in hlo
    copies = [line for line in hlo.splitlines() if " copy(" in line and "s32[0]" not in line]
    assert not copies  # (LRU's empty counts may be copied: no bytes)
    state_x = state_c = sets.empty_state(layout)
    for _ in range(3):
        want = xla(state_x, ids, valid)
        got = program(state_c, ids, valid)
        assert state_c.rows.is_deleted()
        _assert_same(got, want)
        state_x, state_c = want.state, got.state
        ids = jnp.asarray(rng.integers(0, 5000, 128).astype(np.int32))
    args = (sets.empty_state(layout), ids, valid)
    cuda = program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert sets.CPU_TARGET not in cuda
    plain = jax.jit(functools.partial(sets.plan, layout, implementation="xla"))
    assert sets.CPU_TARGET not in plain.lower(*args).as_text()
    with pytest.raises(ValueError, match="implementation"):
        sets.plan(layout, *args, implementation="gpu")


def test_plan_without_donation_keeps_the_given_state():
    layout = sets.set_layout(3000, 1, 300, CacheAlgorithm.LFU)
    program = jax.jit(functools.partial(sets.plan, layout))
    state = sets.empty_state(layout)
    ids = jnp.arange(100, dtype=jnp.int32)
    plan = program(state, ids, jnp.ones(100, bool))
    assert int(plan.n_fill) == 100 and int(plan.state.clock) == 1
    assert int(state.clock) == 0 and bool(jnp.all(state.rows == -1))
    assert int(jnp.sum(state.counts)) == 0


def test_an_older_build_plans_with_xla(monkeypatch):
    """A build without the target: plan() runs plan_sets, saying so (a warning for "cpu")."""
    monkeypatch.setitem(loader._STATE, "optional", ())
    monkeypatch.setattr(sets, "_STALE_WARNED", [])
    layout = sets.set_layout(3000, 1, 300, CacheAlgorithm.LRU)
    args = (sets.empty_state(layout), jnp.arange(50, dtype=jnp.int32), jnp.ones(50, bool))
    with pytest.warns(loader.CpuKernelWarning, match="older build"):
        text = jax.jit(functools.partial(sets.plan, layout, implementation="cpu")).lower(*args)
    assert sets.CPU_TARGET not in text.as_text()
    with pytest.raises(RuntimeError, match="not registered"):
        sets.plan_sets_cpu(layout, *args)
