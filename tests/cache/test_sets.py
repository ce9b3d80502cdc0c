"""The device slot map (``jaxrec.cache.sets``) against a plain loop over its rules."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sets_reference import ReferenceSets, random_batch

from jaxrec.cache import sets
from jaxrec.distributed.types import CacheAlgorithm


def _program(layout):
    return jax.jit(functools.partial(sets.plan_sets, layout))


def _check_step(program, layout, state, ref, ids, valid):
    plan = program(state, jnp.asarray(ids), jnp.asarray(valid))
    slots, fills, evicts, n_rows, overflow = ref.plan(ids.tolist(), valid.tolist())
    assert bool(plan.overflow) == overflow
    got = np.asarray(plan.state.rows)
    np.testing.assert_array_equal(got, ref.held)
    np.testing.assert_array_equal(np.asarray(plan.state.stamps), ref.stamp)
    np.testing.assert_array_equal(np.asarray(plan.state.counts), ref.counts)
    assert int(plan.state.clock) == ref.clock
    if overflow:
        return plan
    np.testing.assert_array_equal(np.asarray(plan.slots), slots)
    nf, ne = int(plan.n_fill), int(plan.n_evict)
    assert nf == len(fills) and ne == len(evicts)
    got_fills = list(
        zip(np.asarray(plan.fill_slots)[:nf], np.asarray(plan.fill_rows)[:nf], strict=True)
    )
    assert [tuple(map(int, f)) for f in got_fills] == fills
    got_ev = zip(np.asarray(plan.evict_slots)[:ne], np.asarray(plan.evict_rows)[:ne], strict=True)
    assert [tuple(map(int, e)) for e in got_ev] == evicts
    assert int(plan.n_rows) == n_rows
    assert int(plan.n_ids) == int(np.sum(valid & (ids >= 0) & (ids < layout.rows)))
    return plan


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
@pytest.mark.parametrize(
    ("rows", "shards", "slots", "alpha"),
    [(500, 1, 24, None), (3000, 1, 300, 1.05), (4001, 3, 130, 1.2), (2000, 2, 97, None)],
)
def test_steps_match_the_reference(algorithm, rows, shards, slots, alpha):
    """Several steps of Zipf or uniform ids, with padding and ids out of range: the
    state, the slots, the moves and the counts as the loop's, step by step."""
    layout = sets.set_layout(rows, shards, slots, CacheAlgorithm(algorithm))
    state = sets.empty_state(layout)
    ref = ReferenceSets(rows, shards, slots, layout.sets, algorithm == "lfu")
    program = _program(layout)
    rng = np.random.default_rng(rows + slots)
    done = 0
    for _ in range(8):
        n = min(96, slots // 2)
        ids, valid = random_batch(rng, rows, n, alpha)
        plan = _check_step(program, layout, state, ref, ids, valid)
        state = plan.state
        done += not bool(plan.overflow)
    assert done >= 4  # the cases mostly fit: the check is of real plans


def test_a_batch_over_a_set_is_refused_and_changes_nothing():
    layout = sets.set_layout(10_000, 1, 64, CacheAlgorithm.LRU)  # 2 sets of 32
    state = sets.empty_state(layout)
    program = _program(layout)
    ids = np.arange(0, 40, dtype=np.int32)
    plan = program(state, jnp.asarray(ids), jnp.ones(40, bool))
    assert not bool(plan.overflow) and int(plan.n_fill) == 40
    state = plan.state
    # 33 rows of one set: more than its 32 slots
    h = sets.set_hash_np(np.arange(10_000)) % layout.sets
    one = np.flatnonzero(h == 0)[:33].astype(np.int32)
    again = program(state, jnp.asarray(one), jnp.ones(33, bool))
    assert bool(again.overflow)
    for a, b in zip(jax.tree.leaves(again.state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layout_sets_split_slots_evenly():
    layout = sets.set_layout(10**7, 4, 100_003, CacheAlgorithm.LRU)
    assert layout.sets == 3126 and layout.ways == 32
    q, r = divmod(layout.slots, layout.sets)
    sizes = [q + (h < r) for h in range(layout.sets)]
    assert sum(sizes) == layout.slots and max(sizes) <= sets.WAYS
    small = sets.set_layout(200, 1, 20, CacheAlgorithm.LRU)
    assert small.sets == 1 and small.ways == 20  # fully associative
    with pytest.raises(ValueError, match="int32 slot map"):
        sets.set_layout(10**10, 1, 10, CacheAlgorithm.LRU)


def test_hash_matches_numpy():
    x = np.array([0, 1, 2, 12345, 2**31 - 1], np.int32)
    np.testing.assert_array_equal(np.asarray(sets.set_hash(jnp.asarray(x))), sets.set_hash_np(x))


@pytest.mark.parametrize("implementation", ["xla", None])  # None: the C++ kernel on CPU
def test_several_tables_are_kept_together_or_refused_together(implementation):
    """Two tables in one program: when one's batch overflows a set, neither changes;
    when both fit, each equals its own plan."""
    a = sets.set_layout(10_000, 1, 64, CacheAlgorithm.LRU)  # 2 sets of 32
    b = sets.set_layout(5_000, 2, 40, CacheAlgorithm.LFU)
    program = jax.jit(functools.partial(sets.plan_many, (a, b), implementation=implementation))
    states = (sets.empty_state(a), sets.empty_state(b))
    fits = [np.arange(0, 40, dtype=np.int32), np.arange(100, 130, dtype=np.int32)]
    ones = [jnp.ones(40, bool), jnp.ones(30, bool)]
    plans = program(states, [jnp.asarray(x) for x in fits], ones)
    for lay, st, ids, v, p in zip((a, b), states, fits, ones, plans, strict=True):
        alone = jax.jit(functools.partial(sets.plan_sets, lay))(st, jnp.asarray(ids), v)
        for x, y in zip(jax.tree.leaves(alone), jax.tree.leaves(p), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    states = tuple(p.state for p in plans)
    h = sets.set_hash_np(np.arange(10_000)) % a.sets
    over = np.flatnonzero(h == 0)[:33].astype(np.int32)  # 33 rows of one 32-slot set
    again = program(
        states, [jnp.asarray(over), jnp.asarray(fits[1] + 1000)], [jnp.ones(33, bool), ones[1]]
    )
    assert [bool(p.overflow) for p in again] == [True, False]
    for before, p in zip(states, again, strict=True):  # b fit, and is put back too
        for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(p.state), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
