"""The C++ hash index (``jaxrec_zch_train_step``, ``jaxrec_zch_remap``) against the XLA one.

Every output of ``zch_index.train_step`` on CPU (the kernel) is compared with
``train_step_xla``'s bit for bit over many random calls: the state, the rows, the
evicted rows (their positions too) and the counts; and with the plain-Python index
(``tests/zch_reference.py``). Layouts cover 1 to 32 ways, a shard's block of the
buckets (ids of other shards' buckets in every batch), every eviction policy and
admission, padding, duplicate ids, batches larger than the table, 64-bit ids.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from zch_reference import FILL, ReferenceZch

from jaxrec.cpu import loader
from jaxrec.cpu import zch as cpu_zch
from jaxrec.modules import zch_index as zi
from jaxrec.modules.zch_policies import (
    FrequencyAdmission,
    HashZchEvictionConfig,
    HashZchEvictionPolicyName,
    ProbabilityAdmission,
)
from jaxrec.sparse.ids64 import from_id_words, to_id_words

P = HashZchEvictionPolicyName


@pytest.fixture(autouse=True)
def _kernel():
    if not cpu_zch.ready():
        pytest.skip(f"no {cpu_zch.TRAIN_TARGET}: {loader.unavailable_reason() or 'an older build'}")


def _layout(slots, ways, total, offset, row_offset, seed, policy, admission):
    eviction = {
        "lru": HashZchEvictionConfig(policy=P.LRU_EVICTION),
        "lfu": HashZchEvictionConfig(policy=P.LFU_EVICTION),
        "ttl": HashZchEvictionConfig(policy=P.SINGLE_TTL_EVICTION, single_ttl=2),
    }[policy]
    adm = None
    if admission and admission[0] == "freq":
        adm = FrequencyAdmission(threshold=admission[1])
    elif admission:
        adm = ProbabilityAdmission(probability=admission[1])
    return zi.ZchLayout(
        slots=slots,
        ways=ways,
        total_buckets=total,
        bucket_offset=offset,
        row_offset=row_offset,
        seed=seed,
        eviction=eviction,
        admission=adm,
    )


# slots, ways, total_buckets, bucket_offset, row_offset, seed, policy, admission, C, E
CASES = [
    (64, 1, 64, 0, 0, 0, "lru", None, 40, 40),
    (64, 4, 48, 8, 1000, 7, "lfu", ("freq", 2), 96, 103),  # C > S; E > C
    (128, 16, 24, 16, 77, 1, "ttl", ("prob", 0.6), 50, 5),  # E < C: packed, some dropped
    (64, 32, 2, 0, 0, 3, "lru", ("freq", 1), 80, 64),  # E = min(C, S)
    (256, 16, 16, 0, 5, 2**32 - 1, "lfu", None, 64, 64),
    (96, 32, 9, 6, 300, 11, "ttl", ("freq", 3), 128, 128),  # the last 3 of 9 buckets
    (64, 4, 16, 0, 0, 5, "lru", ("prob", 0.3), 48, 48),
    (32, 1, 100, 50, 2000, 9, "ttl", None, 24, 24),
    (64, 16, 8, 4, 0, 4, "lfu", ("prob", 1.0), 40, 40),
    (64, 16, 4, 0, 0, 6, "lru", ("freq", 2), 40, 3),
]


def _stream(rng, steps, c, *, live=160, drift=16):
    """Batches of 64-bit ids (some with the high word set, some negative as int64) from a
    Zipf window that drifts: new ids arrive, old ones retire. Yields (uint64 ids, valid)."""
    kinds = np.array([0, 0x1234_5678_0000_0000, 0xFFFF_FFFF_FFFF_0000], np.uint64)
    for step in range(steps):
        rank = np.minimum(rng.zipf(1.2, c) - 1, live - 1).astype(np.uint64) + np.uint64(
            step * drift
        )
        ids = kinds[rank % np.uint64(3)] + rank * np.uint64(2**32 + 3)
        valid = rng.random(c) > 0.15
        yield ids, valid


@functools.cache
def _programs(layout: zi.ZchLayout, e: int):
    xla = jax.jit(functools.partial(zi.train_step_xla, layout, max_evictions=e))
    cpu = jax.jit(functools.partial(zi.train_step, layout, max_evictions=e))
    return xla, cpu


@functools.cache
def _remaps(layout: zi.ZchLayout):
    return jax.jit(functools.partial(zi.remap_xla, layout)), jax.jit(
        functools.partial(zi.remap, layout)
    )


def _assert_same(got, want):
    leaves = jax.tree_util.tree_leaves_with_path(want)
    for (path, x), y in zip(leaves, jax.tree.leaves(got), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=str(path))


def _words(ids):
    w = jnp.asarray(to_id_words(ids))
    return w[:, 0], w[:, 1]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[6]}-{c[7]}-C{c[8]}E{c[9]}")
def test_calls_match_xla_and_the_reference(case):
    *lay, c, e = case
    layout = _layout(*lay)
    xla, cpu = _programs(layout, e)
    slots, ways, total, offset, row_offset, seed, policy, admission = lay
    ref = ReferenceZch(
        slots,
        ways,
        total_buckets=total,
        bucket_offset=offset,
        row_offset=row_offset,
        seed=seed,
        policy=policy,
        ttl=2 if policy == "ttl" else None,
        admission=admission,
    )
    text = cpu.lower(zi.empty_state(layout), *_words(np.zeros(c, np.uint64)), jnp.ones(c, bool))
    assert cpu_zch.TRAIN_TARGET in text.as_text()
    rng = np.random.default_rng(sum(case[:2]) + c)
    state = zi.empty_state(layout)
    seen = {"admitted": 0, "evicted": 0, "rejected": 0}
    for step, (ids, valid) in enumerate(_stream(rng, 14, c)):
        if step == 5:
            ids[:] = ids[0]  # one id, every occurrence
        lo, hi = _words(ids)
        want = xla(state, lo, hi, jnp.asarray(valid))
        got = cpu(state, lo, hi, jnp.asarray(valid))
        _assert_same(got, want)
        rows, evicted, counts = ref.train([int(i) for i in ids], valid.tolist())
        np.testing.assert_array_equal(np.asarray(got.rows), rows)
        if e >= min(c, slots):  # none dropped
            assert sorted(int(r) for r in np.asarray(got.evicted) if r != FILL) == evicted
        assert {k: int(v) for k, v in got.counts._asdict().items()} == counts
        assert int(got.state.occupancy) == ref.occupancy()
        for k in seen:
            seen[k] += counts[k]
        state = got.state
        remap_x, remap_c = (f(state, lo, hi, jnp.asarray(valid)) for f in _remaps(layout))
        np.testing.assert_array_equal(np.asarray(remap_c), np.asarray(remap_x))
        np.testing.assert_array_equal(
            np.asarray(remap_c), ref.remap([int(i) for i in ids], valid.tolist())
        )
    assert seen["admitted"] > 0
    assert seen["evicted"] > 0 or policy == "ttl" or slots >= 256


@pytest.mark.parametrize("policy", ["lru", "lfu", "ttl"])
def test_any_state_matches_xla(policy):
    """States no training reaches (an id in two ways, stamps ahead of the clock or below
    -1, counts and sketch cells about to wrap, the clock about to wrap): still bit for
    bit."""
    layout = _layout(64, 8, 16, 4, 10, 2, policy, ("freq", 3))
    xla, cpu = _programs(layout, 70)
    rng = np.random.default_rng(len(policy))
    pool = np.concatenate(
        [np.arange(40, dtype=np.uint64), np.uint64(2**63) + np.arange(40, dtype=np.uint64)]
    )
    big = np.iinfo(np.int32).max
    for it in range(12):
        held = rng.choice(pool, 64)
        now = [5, 0, big - 1, big][it % 4]  # current_iter; big: the clock wraps below 0
        seen = rng.choice(np.array([-1, -5, now - 3, now - 1, now, now + 1], np.int64), 64)
        lo, hi = _words(held)
        state = zi.ZchState(
            id_lo=lo,
            id_hi=hi,
            last_seen=jnp.asarray(seen.astype(np.int32)),
            counts=jnp.asarray(rng.choice([0, 1, 3, big - 1, big, -big], 64).astype(np.int32)),
            sketch=jnp.asarray(rng.choice([0, 1, 2, big - 2, big], 64).astype(np.int32)),
            current_iter=jnp.int32(now),
            occupancy=jnp.int32(rng.integers(0, 64)),
        )
        ids = rng.choice(pool, 70)
        valid = jnp.asarray(rng.random(70) > 0.1)
        _assert_same(cpu(state, *_words(ids), valid), xla(state, *_words(ids), valid))


def test_empty_and_all_padding_batches():
    layout = _layout(64, 4, 16, 0, 0, 0, "lfu", ("freq", 1))
    for c in (0, 5):
        args = (zi.empty_state(layout), *_words(np.arange(c, dtype=np.uint64)), jnp.zeros(c, bool))
        want = jax.jit(functools.partial(zi.train_step_xla, layout, max_evictions=c))(*args)
        got = jax.jit(functools.partial(zi.train_step, layout, max_evictions=c))(*args)
        _assert_same(got, want)
        assert int(got.state.current_iter) == 1


def test_donated_state_is_updated_in_place():
    """Donated, the state's buffers are the kernel's results: no copy in the program, the
    same buffer pointers after the call; the program lowered for CUDA is the XLA one."""
    layout = _layout(4096, 16, 256, 0, 0, 0, "lfu", ("freq", 2))
    program = jax.jit(functools.partial(zi.train_step, layout, max_evictions=256), donate_argnums=0)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 2**40, 256).astype(np.uint64)
    args = (zi.empty_state(layout), *_words(ids), jnp.ones(256, bool))
    hlo = program.lower(*args).compile().as_text()
    assert cpu_zch.TRAIN_TARGET in hlo and " sort(" not in hlo
    assert not [line for line in hlo.splitlines() if " copy(" in line]
    state = zi.empty_state(layout)
    for _ in range(3):
        before = [x.unsafe_buffer_pointer() for x in state[:5]]
        out = program(state, *_words(ids), jnp.ones(256, bool))
        assert state.id_lo.is_deleted()
        assert [x.unsafe_buffer_pointer() for x in out.state[:5]] == before
        state = out.state
        ids = rng.integers(0, 2**40, 256).astype(np.uint64)
    assert int(state.occupancy) > 0
    cuda = program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert cpu_zch.TRAIN_TARGET not in cuda
    remap = jax.jit(functools.partial(zi.remap, layout))
    cuda = remap.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert cpu_zch.REMAP_TARGET not in cuda and cpu_zch.REMAP_TARGET in remap.lower(*args).as_text()


def test_without_donation_the_given_state_is_kept():
    layout = _layout(64, 4, 16, 0, 0, 0, "lru", None)
    state = zi.empty_state(layout)
    out = jax.jit(functools.partial(zi.train_step, layout, max_evictions=8))(
        state, *_words(np.arange(8, dtype=np.uint64)), jnp.ones(8, bool)
    )
    assert int(out.counts.admitted) == 8 and int(out.state.occupancy) == 8
    assert int(state.current_iter) == 0 and bool(jnp.all(state.last_seen == -1))


def test_an_older_build_indexes_with_xla(monkeypatch):
    """A build without the targets: train_step and remap run XLA (saying so once)."""
    monkeypatch.setitem(loader._STATE, "optional", ())
    monkeypatch.setattr(cpu_zch, "_STALE_WARNED", [])
    layout = _layout(64, 4, 16, 0, 0, 0, "lru", None)
    args = (zi.empty_state(layout), *_words(np.arange(8, dtype=np.uint64)), jnp.ones(8, bool))
    text = jax.jit(functools.partial(zi.train_step, layout, max_evictions=8)).lower(*args)
    assert cpu_zch.TRAIN_TARGET not in text.as_text()
    assert (
        cpu_zch.REMAP_TARGET
        not in jax.jit(functools.partial(zi.remap, layout)).lower(*args).as_text()
    )
    with pytest.raises(RuntimeError, match="not registered"):
        cpu_zch.remap_cpu(zi._kernel_layout(layout), *args[0][:3], *args[1:])


def test_ids_round_trip():  # the id words the tests build are the ids
    ids = np.array([0, 2**63 + 5, 2**64 - 1], np.uint64)
    np.testing.assert_array_equal(from_id_words(np.asarray(jnp.stack(_words(ids), 1))), ids)


def test_vmapped_calls_match_xla():
    """Under vmap each element is one call: a batch of states and ids (train), a batch of
    ids on one state (remap)."""
    layout = _layout(64, 4, 16, 0, 0, 0, "lfu", ("freq", 2))
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 90, (3, 40)).astype(np.uint64) + np.uint64(2**35)
    w = jnp.asarray(to_id_words(ids.ravel())).reshape(3, 40, 2)
    lo, hi, valid = w[..., 0], w[..., 1], jnp.asarray(rng.random((3, 40)) > 0.1)
    states = jax.tree.map(lambda x: jnp.stack([x] * 3), zi.empty_state(layout))

    def run(fn):
        step = functools.partial(fn, layout, max_evictions=40)
        out = jax.jit(jax.vmap(step))(states, lo, hi, valid)
        out2 = jax.jit(jax.vmap(step))(out.state, lo[::-1], hi[::-1], valid)
        one = jax.tree.map(lambda x: x[1], out2.state)
        remap = {zi.train_step: zi.remap, zi.train_step_xla: zi.remap_xla}[fn]
        rows = jax.jit(jax.vmap(functools.partial(remap, layout, one)))(lo, hi, valid)
        return out, out2, rows

    _assert_same(run(zi.train_step), run(zi.train_step_xla))


def test_inside_shard_map_matches_xla():
    """Each of 4 devices indexes its own ids on its own state (a dynamic table's shard runs
    the index inside shard_map): the kernel's results are XLA's."""
    from jax.sharding import PartitionSpec as P_

    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    layout = _layout(64, 8, 8, 0, 0, 0, "ttl", ("prob", 0.7))
    rng = np.random.default_rng(2)
    w = jnp.asarray(to_id_words(rng.integers(0, 2**40, 4 * 48).astype(np.uint64)))
    lo, hi = w[:, 0], w[:, 1]
    valid = jnp.asarray(rng.random(4 * 48) > 0.1)
    states = jax.tree.map(lambda x: jnp.stack([x] * 4), zi.empty_state(layout))

    def run(fn):
        def body(state, lo, hi, valid):
            state = jax.tree.map(lambda x: x[0], state)
            out = fn(layout, state, lo, hi, valid, max_evictions=48)
            return jax.tree.map(lambda x: x[None], out)

        spec = P_("x")
        program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
        put = functools.partial(jax.device_put, device=jax.NamedSharding(mesh, spec))
        args = jax.tree.map(put, (states, lo, hi, valid))
        kernel = cpu_zch.TRAIN_TARGET in program.lower(*args).as_text()
        assert kernel == (fn is zi.train_step)
        first = program(*args)
        return first, program(first.state, *jax.tree.map(put, (hi, lo, valid)))

    _assert_same(run(zi.train_step), run(zi.train_step_xla))
