"""Managed collision: against a plain-Python reference of TorchRec's algorithm, and TorchRec."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from mc_reference import RefMCH
from torchrec_helpers import needs_torchrec

from jaxrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    JaggedTensor,
    KeyedJaggedTensor,
    optim,
    train,
)
from jaxrec.embedding import CombinedOptimizer
from jaxrec.modules import (
    EVICTION_FILL,
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
    MCState,
    average_threshold_filter,
    dynamic_threshold_filter,
    hash_id_pairs,
    hash_ids,
    hash_ids_64,
)

C = 16  # id capacity per call


@nnx.jit
def _train(m, values, lengths):
    out = m({"t": JaggedTensor(values=values, lengths=lengths)})["t"].values()
    return out, m.evict()


@nnx.jit
def _flat(m, values, valid):
    return m.forward_flat(values, valid)


@nnx.jit
def _eval(m, values, lengths):
    return m({"t": JaggedTensor(values=values, lengths=lengths)}, deterministic=True)["t"].values()


def _stream(seed, steps, *, span=40, bad=False, cap=C):
    """Zipf-ish batches ``(values [cap] int32, lengths [4], raw list with None padding)``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.multinomial(rng.integers(0, cap + 1), [0.25] * 4)
        n = int(lengths.sum())
        raw = (rng.zipf(1.4, size=n) - 1) % span
        if bad and n:  # negative and too-large ids: never admitted
            raw[rng.random(n) < 0.15] = -3
            raw[rng.random(n) < 0.1] = 10_000
        values = np.zeros(cap, np.int32)
        values[:n] = raw
        out.append((values, lengths.astype(np.int32), raw.tolist() + [None] * (cap - n)))
    return out


def _check_against_reference(m, ref, batches, train=True, residual=None):
    for values, lengths, raw in batches:
        if train:
            rows, ev = _train(m, jnp.asarray(values), jnp.asarray(lengths))
        else:
            rows, ev = _eval(m, jnp.asarray(values), jnp.asarray(lengths)), None
        want_rows, want_ev = ref.step(raw, train, residual)
        n = int(lengths.sum())
        assert np.asarray(rows)[:n].tolist() == want_rows[:n]
        if ev is not None:
            ev = np.asarray(ev)
            assert ev.tolist() == want_ev + [EVICTION_FILL] * (ev.shape[0] - len(want_ev))
    table = [[int(k), int(r), int(c), int(a)] for k, r, c, a in zip(*_table(m), strict=True)]
    assert [e[:2] for e in table] == [e[:2] for e in ref.table]
    used = [i for i, e in enumerate(ref.table) if e[0] != 2**32 - 1 and i < ref.z - 1]
    if ref.policy != "lru":
        assert [table[i][2] for i in used] == [ref.table[i][2] for i in used]
    if ref.policy != "lfu":
        assert [table[i][3] for i in used] == [ref.table[i][3] for i in used]


def _table(m):
    return tuple(np.asarray(x[...]) for x in (m.sorted_ids, m.slots, m.counts, m.last_access))


POLICIES = {
    "lfu": (lambda: LFU_EvictionPolicy(), {}),
    "lru": (lambda: LRU_EvictionPolicy(), {}),
    "lru_decay2": (lambda: LRU_EvictionPolicy(decay_exponent=2.0), {"decay": 2.0}),
    "dlfu": (lambda: DistanceLFU_EvictionPolicy(), {}),
    "dlfu_decay2": (lambda: DistanceLFU_EvictionPolicy(decay_exponent=2.0), {"decay": 2.0}),
    "lfu_average": (
        lambda: LFU_EvictionPolicy(threshold_filtering_func=average_threshold_filter),
        {"threshold": ("average", None)},
    ),
    "dlfu_dynamic": (
        lambda: DistanceLFU_EvictionPolicy(
            threshold_filtering_func=functools.partial(
                dynamic_threshold_filter, threshold_skew_multiplier=1.5
            )
        ),
        {"threshold": ("dynamic", 1.5)},
    ),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_policies_match_reference(name):
    make, kw = POLICIES[name]
    kind = name.split("_")[0]
    m = MCHManagedCollisionModule(
        12, eviction_policy=make(), eviction_interval=3, history_capacity=3 * C
    )
    ref = RefMCH(12, kind, 3, **kw)
    _check_against_reference(m, ref, _stream(hash(name) % 1000, 14, bad=True))
    # eval calls remap only: state and evictions untouched
    before = jax.tree.map(jnp.copy, nnx.state(m, MCState))
    _check_against_reference(m, ref, _stream(7, 2, bad=True), train=False)
    after = nnx.state(m, MCState)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), before, after)))


def test_offset_history_overflow_and_capped_evictions_match_reference():
    kw = dict(output_global_offset=100, history_capacity=10, max_evictions=3)
    m = MCHManagedCollisionModule(
        12, eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=2, **kw
    )
    assert m.max_evictions == 3 and m.output_size() == 12
    ref = RefMCH(12, "dlfu", 2, offset=100, history_capacity=10, max_evictions=3)
    _check_against_reference(m, ref, _stream(3, 12, span=60))


def test_mch_residual_range():
    m = MCHManagedCollisionModule(
        8,
        eviction_policy=LFU_EvictionPolicy(),
        eviction_interval=2,
        input_hash_size=500,
        mch_size=5,
        output_global_offset=10,
        history_capacity=2 * C,
    )
    assert m.output_size() == 13 and m.input_size() == 500

    def residual(k):
        return int(hash_ids(jnp.asarray([k], jnp.uint32), 5)[0])

    ref = RefMCH(8, "lfu", 2, input_hash_size=500, mch_size=5, offset=10)
    batches = _stream(11, 8, span=30, bad=True)
    _check_against_reference(m, ref, batches, residual=residual)
    rows = np.concatenate(
        [np.asarray(_eval(m, jnp.asarray(v), jnp.asarray(n))) for v, n, _ in batches]
    )
    assert rows.min() >= 10 and rows.max() < 23 and (rows >= 18).any()


def test_matches_torchrec():
    torch, _ = needs_torchrec()
    from torchrec.modules import mc_modules as tmc
    from torchrec.sparse.jagged_tensor import JaggedTensor as TJT

    cases = [
        (tmc.LFU_EvictionPolicy(), LFU_EvictionPolicy()),
        (tmc.LRU_EvictionPolicy(), LRU_EvictionPolicy()),
        (
            tmc.DistanceLFU_EvictionPolicy(decay_exponent=0.5),
            DistanceLFU_EvictionPolicy(decay_exponent=0.5),
        ),
        (
            tmc.LFU_EvictionPolicy(threshold_filtering_func=tmc.average_threshold_filter),
            LFU_EvictionPolicy(threshold_filtering_func=average_threshold_filter),
        ),
    ]
    for i, (tp, jp) in enumerate(cases):
        kw = dict(zch_size=10, eviction_interval=2, input_hash_size=100)
        t = tmc.MCHManagedCollisionModule(device=torch.device("cpu"), eviction_policy=tp, **kw)
        m = MCHManagedCollisionModule(eviction_policy=jp, history_capacity=2 * C, **kw)
        rng = np.random.default_rng(i)
        for _ in range(10):  # full batches: TorchRec sizes its history by the first one
            v = (rng.zipf(1.3, size=C) - 1) % 40
            got, ev = _train(m, jnp.asarray(v, jnp.int32), jnp.array([4, 4, 4, 4], jnp.int32))
            tjt = TJT(values=torch.tensor(v), lengths=torch.tensor([4, 4, 4, 4]))
            want = t({"t": tjt})["t"].values().numpy()
            assert np.asarray(got).tolist() == want.tolist()
            tev = t.evict()
            ev = np.asarray(ev)
            assert sorted(ev[ev != EVICTION_FILL].tolist()) == sorted(
                [] if tev is None else tev.tolist()
            )
        assert np.asarray(m.sorted_ids[...])[:-1].tolist() == [
            x if x < 2**63 - 1 else 2**32 - 1 for x in t._mch_sorted_raw_ids.tolist()[:-1]
        ]


def test_collision_free_within_capacity_and_deterministic():
    ids = np.array([5, 2**31 - 2, 17, 123456, 9, 0, 77, 1_000_000], np.int32)  # 8 distinct
    runs = []
    for _ in range(2):
        m = MCHManagedCollisionModule(
            9, eviction_policy=LRU_EvictionPolicy(), eviction_interval=2, history_capacity=2 * C
        )
        rng = np.random.default_rng(0)
        outs = []
        for step in range(6):
            v = rng.permutation(np.concatenate([ids, ids]))[:C]
            rows, ev = _train(m, jnp.asarray(v), jnp.array([4, 4, 4, 4], jnp.int32))
            rows, ev = np.asarray(rows), np.asarray(ev)
            outs.append(rows)
            if step == 0:  # nothing admitted before the first eviction: all misses
                assert (rows == 8).all() and (ev == EVICTION_FILL).all()
            if step == 1:  # the first eviction admits all 8 into the empty slots
                assert sorted(ev[ev != EVICTION_FILL].tolist()) == list(range(8))
            if step >= 1:
                mapping = dict(zip(v.tolist(), rows.tolist(), strict=True))
                assert len(set(mapping.values())) == len(mapping) and 8 not in mapping.values()
            if step >= 2:
                assert (ev == EVICTION_FILL).all()  # within capacity: nothing evicted again
        assert int(m.open_slots()) == 0
        runs.append((outs, _table(m)))
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_eviction_interval_and_history():
    m = MCHManagedCollisionModule(6, eviction_policy=LFU_EvictionPolicy(), eviction_interval=3)
    v = jnp.asarray(np.arange(C) % 4, jnp.int32)
    lengths = jnp.array([4, 4, 4, 0], jnp.int32)  # 12 ids, 4 of them padding
    for step in range(1, 8):
        _, ev = _train(m, v, lengths)
        evicted = np.asarray(ev) != EVICTION_FILL
        assert evicted.any() == (step == 3), step  # ids 0..3 admitted once, then no change
        assert int(m.current_iter[...]) == step
        assert int(m.history_len[...]) == (step % 3) * 12
    assert m.history_ids.shape == (C * 3,)  # allocated by the first call: capacity x interval
    assert np.asarray(m.counts[...])[:4].tolist() == [18] * 4  # 3 a call, 3 calls, 2 evictions


def test_rebuild_with_output_id_range_and_open_slots():
    m = MCHManagedCollisionModule(
        20,
        eviction_policy=LRU_EvictionPolicy(decay_exponent=2.0),
        eviction_interval=4,
        input_hash_size=1000,
        history_capacity=64,
        name="user",
    )
    s = m.rebuild_with_output_id_range((40, 48))
    assert (s.zch_size, s.output_global_offset, s.name) == (8, 40, "user")
    assert s.eviction_policy == m.eviction_policy and s.history_ids.shape == (64,)
    assert np.asarray(s.slots[...]).tolist() == list(range(40, 48))
    assert int(s.open_slots()) == 7 and int(m.open_slots()) == 19


def test_hashing_64_bit_ids():
    def murmur(x):  # MurmurHash3 x86_32 of 8 little-endian bytes, pure Python
        mask, h = 0xFFFFFFFF, 0
        data = int(x).to_bytes(8, "little", signed=x < 0)
        for i in (0, 4):
            k = int.from_bytes(data[i : i + 4], "little") * 0xCC9E2D51 & mask
            k = ((k << 15) | (k >> 17)) & mask
            h ^= k * 0x1B873593 & mask
            h = (((h << 13) | (h >> 19)) * 5 + 0xE6546B64) & mask
        h ^= 8
        h = (h ^ (h >> 16)) * 0x85EBCA6B & mask
        h = (h ^ (h >> 13)) * 0xC2B2AE35 & mask
        return h ^ (h >> 16)

    ids = [0, 1, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 7, 2**62 + 3, 2**63 - 1, -1, -(2**63)]
    for n in (1, 7, 1000, 2**31, 2**32 - 1):
        want = [murmur(x) % n for x in ids]
        assert hash_ids_64(np.array(ids, np.int64), n).tolist() == want
        u = np.array(ids, np.int64).view(np.uint64)
        hi, lo = (
            (u >> np.uint64(32)).astype(np.uint32),
            (u & np.uint64(2**32 - 1)).astype(np.uint32),
        )
        assert np.asarray(hash_id_pairs(jnp.asarray(hi), jnp.asarray(lo), n)).tolist() == want
    assert hash_ids_64([2**64 - 1], 1000).tolist() == [murmur(-1) % 1000]  # uint64 input
    small = np.array([0, 5, 2**31 - 1, -7], np.int32)
    assert np.asarray(hash_ids(jnp.asarray(small), 999)).tolist() == [
        murmur(x) % 999 for x in small.tolist()
    ]
    big = np.array([2**31, 2**32 - 2], np.uint32)
    assert np.asarray(hash_ids(jnp.asarray(big), 999)).tolist() == [
        murmur(x) % 999 for x in big.tolist()
    ]
    spread = np.bincount(hash_ids_64(np.arange(2**40, 2**40 + 20_000), 10), minlength=10)
    assert spread.min() > 1800  # roughly uniform over the range


def test_hashed_64_bit_ids_through_the_module():
    raw = np.array([2**40 + 1, 2**40 + 2, 2**33, 2**40 + 1, 5, 2**63 - 1], np.int64)
    n = 2**32 - 1
    m = MCHManagedCollisionModule(8, eviction_policy=LFU_EvictionPolicy(), eviction_interval=1)
    keys = hash_ids_64(raw, n)  # host side, uint32
    assert keys.dtype == np.uint32
    kjt = KeyedJaggedTensor(["f"], keys, lengths=[4, 2])
    assert kjt.values().dtype == jnp.uint32
    rows = np.asarray(_flat(m, kjt.values(), None))
    assert rows[0] == rows[3] and len(set(rows.tolist())) == 5 and 7 not in rows.tolist()
    # in-graph hashing of the same ids' halves gives the same rows (eval: no new admissions)
    hashed = MCHManagedCollisionModule(
        8, eviction_policy=LFU_EvictionPolicy(), eviction_interval=1, input_hash_func=hash_ids
    )
    ids32 = jnp.asarray([-1, 2**31 - 1, -1], jnp.int32)  # hash_ids sign-extends: -1 is 2**64 - 1
    got = np.asarray(hashed.keys(ids32))
    assert got.tolist() == hash_ids_64([-1, 2**31 - 1, -1], n).tolist()


def test_uint32_and_out_of_range_ids():
    m = MCHManagedCollisionModule(
        6, eviction_policy=LFU_EvictionPolicy(), eviction_interval=1, input_hash_size=2**32 - 1
    )
    v = jnp.asarray([2**32 - 2, 2**31 + 5, 2**32 - 1, 3], jnp.uint32)  # 2**32 - 1: out of range
    rows = np.asarray(_flat(m, v, jnp.array([True, True, True, False])))
    assert rows[2] == 5 and rows[3] == 5 and rows[0] != rows[1] and max(rows[:2]) < 5
    assert sorted(np.asarray(m.sorted_ids[...])[:2].tolist()) == [2**31 + 5, 2**32 - 2]
    small = MCHManagedCollisionModule(
        6, eviction_policy=LFU_EvictionPolicy(), eviction_interval=1, input_hash_size=10
    )
    rows = np.asarray(_flat(small, jnp.asarray([3, 10, -1, 9], jnp.int32), None))
    assert rows.tolist()[1:3] == [5, 5] and rows[0] != 5 and rows[3] != 5
    assert int(small.open_slots()) == 3


def test_int64_ids_with_scoped_x64():
    with jax.enable_x64(True):
        m = MCHManagedCollisionModule(6, eviction_policy=LFU_EvictionPolicy(), eviction_interval=1)
        rows = m.forward_flat(jnp.asarray([2**40, 7, 7, -2, 2**32 - 2], jnp.int64))
        assert rows[1] == rows[2]
        assert rows[0] == 5 and rows[3] == 5 and rows[4] != 5 and rows.dtype == jnp.int32


def _mcc(interval=2):
    configs = [
        EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["a", "b"]),
        EmbeddingBagConfig(name="u", embedding_dim=4, num_embeddings=7, feature_names=["c"]),
    ]
    lfu, lru = LFU_EvictionPolicy(), LRU_EvictionPolicy()
    modules = {
        "t": MCHManagedCollisionModule(10, eviction_policy=lfu, eviction_interval=interval),
        "u": MCHManagedCollisionModule(7, eviction_policy=lru, eviction_interval=interval),
    }
    return ManagedCollisionCollection(modules, configs), configs


def test_collection_matches_modules_and_jits():
    mcc, configs = _mcc()
    single, _ = _mcc()
    rng = np.random.default_rng(5)
    batches = []
    for _ in range(6):  # keys in another order than the tables', plus an unmanaged one
        lengths = rng.integers(0, 3, size=4 * 3).astype(np.int32)
        values = rng.integers(0, 30, size=int(lengths.sum())).astype(np.int32)
        w = rng.random(values.shape[0]).astype(np.float32)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["c", "a", "z", "b"], values, lengths, w, capacities=8
        )
        batches.append(kjt)
    mcc.ensure_buffers(batches[0])
    graphdef, state = nnx.split(mcc)
    traces = []

    @jax.jit
    def step(state, kjt):  # the train step's pattern: merge, forward, split
        traces.append(1)
        m = nnx.merge(graphdef, state)
        out = m(kjt)
        return nnx.state(m), out, m.evict()

    for kjt in batches:
        state, out, ev = step(state, kjt)
        assert out.keys() == kjt.keys() and out.values().dtype == jnp.int32
        np.testing.assert_array_equal(out.lengths(), kjt.lengths())
        np.testing.assert_array_equal(out.weights(), kjt.weights())
        # the same: module "t" fed "a" then "b" (its features' order), "u" fed "c"
        d = kjt.to_dict()
        valid = {k: jt.valid_mask() for k, jt in d.items()}
        mods = single.managed_collision_modules
        rows_t = _flat(
            mods["t"],
            jnp.concatenate([d["a"].values(), d["b"].values()]),
            jnp.concatenate([valid["a"], valid["b"]]),
        )
        rows_u = _flat(mods["u"], d["c"].values(), valid["c"])
        got = out.to_dict()
        for key, want in (("a", rows_t[:8]), ("b", rows_t[8:]), ("c", rows_u)):
            keep = np.asarray(valid[key])
            np.testing.assert_array_equal(
                np.asarray(got[key].values())[keep], np.asarray(want)[keep]
            )
        for t in ("t", "u"):
            np.testing.assert_array_equal(ev[t], single.evict()[t])
    assert len(traces) == 1
    assert set(mcc.embedding_configs()[0].feature_names) == {"a", "b"}


def test_collection_passthrough_and_eval_mode():
    mcc, _ = _mcc(interval=1)
    kjt = KeyedJaggedTensor(
        ["a", "x", "b", "c"], [3, 99, 4, 3, 5], lengths=[1, 0, 1, 0, 1, 0, 2, 0]
    )
    mcc.eval()
    assert mcc.managed_collision_modules["t"].deterministic
    out = mcc(kjt)  # eval: nothing admitted, all misses
    assert out.to_dict()["x"].values().tolist() == [99]
    assert out["a"].values().tolist() == [9] and out["c"].values().tolist() == [6, 6]
    mcc.train()
    out = mcc(kjt)
    assert out["a"].values().tolist() != [9] and out["x"].values().tolist() == [99]
    assert out["c"].values()[0] != 6
    assert set(mcc.evict()) == {"t", "u"} and {k: int(v) for k, v in mcc.open_slots().items()} == {
        "t": 7,
        "u": 4,
    }


def test_bad_configs_and_inputs():
    lfu = LFU_EvictionPolicy()
    with pytest.raises(ValueError, match="zch_size"):
        MCHManagedCollisionModule(1, eviction_policy=lfu, eviction_interval=1)
    with pytest.raises(ValueError, match="eviction_interval"):
        MCHManagedCollisionModule(4, eviction_policy=lfu, eviction_interval=0)
    with pytest.raises(TypeError, match="eviction_policy"):
        MCHManagedCollisionModule(4, eviction_policy="lfu", eviction_interval=1)
    with pytest.raises(ValueError, match="input_hash_size"):
        MCHManagedCollisionModule(
            4, eviction_policy=lfu, eviction_interval=1, input_hash_size=2**32
        )
    with pytest.raises(ValueError, match="mch_size"):
        MCHManagedCollisionModule(
            4, eviction_policy=lfu, eviction_interval=1, mch_hash_func=hash_ids
        )
    with pytest.raises(ValueError, match="2\\*\\*31"):
        MCHManagedCollisionModule(
            4, eviction_policy=lfu, eviction_interval=1, output_global_offset=2**31 - 3
        )
    m = MCHManagedCollisionModule(4, eviction_policy=lfu, eviction_interval=1)
    with pytest.raises(ValueError, match="history_capacity"):
        m.evict()
    with pytest.raises(TypeError, match="integer"):
        m.forward_flat(jnp.zeros((3,), jnp.float32))
    raw = {"t": JaggedTensor(values=jnp.zeros((2,), jnp.int32), lengths=jnp.array([2]))}
    with pytest.raises(TypeError, match="preprocess"):
        m.remap(raw)
    with pytest.raises(TypeError, match="preprocess"):
        m.profile(raw)
    assert m.remap(m.preprocess(raw))["t"].values().tolist() == [3, 3]
    with pytest.raises(ValueError, match="2 ids lie outside"):
        m.validate_ids(np.array([3, -1, 2**31 - 1, -5], np.int32))
    small = MCHManagedCollisionModule(
        4, eviction_policy=lfu, eviction_interval=1, input_hash_size=10
    )
    with pytest.raises(ValueError, match="input_hash_size=10"):
        small.validate_ids(np.array([3, 10, 12], np.int32), np.array([True, True, False]))
    small.validate_ids(np.array([3, 9, 12], np.int32), np.array([True, True, False]))
    with pytest.raises(TypeError, match="dict of JaggedTensor"):
        m(JaggedTensor(values=jnp.zeros((2,), jnp.int32), lengths=jnp.array([2])))
    with pytest.raises(TypeError, match="hash_ids_64"):
        hash_ids(jnp.zeros((2,), jnp.float32), 10)
    with pytest.raises(ValueError, match="input_hash_size"):
        hash_ids_64([1], 0)
    cfg = EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=5, feature_names=["a"])
    with pytest.raises(ValueError, match="num_embeddings=5"):
        ManagedCollisionCollection({"t": m}, [cfg])
    with pytest.raises(ValueError, match="missing \\['t'\\]"):
        ManagedCollisionCollection({}, [cfg])
    good = MCHManagedCollisionModule(5, eviction_policy=lfu, eviction_interval=1)
    cfg2 = EmbeddingBagConfig(name="u", embedding_dim=2, num_embeddings=5, feature_names=["a"])
    with pytest.raises(ValueError, match="feeds tables"):
        ManagedCollisionCollection({"t": good, "u": good}, [cfg, cfg2])
    mcc = ManagedCollisionCollection({"t": good}, [cfg])
    with pytest.raises(ValueError, match="lack the managed keys"):
        mcc(KeyedJaggedTensor(["b"], [1], lengths=[1]))


class _RemapModel(nnx.Module):
    def __init__(self, mcc, configs):
        self.mcc = mcc
        self.ebc = EmbeddingBagCollection(configs, rngs=nnx.Rngs(0))

    def __call__(self, kjt):
        return jnp.sum(self.ebc(self.mcc(kjt)).values() ** 2)


def test_lowers_for_cuda():
    m = MCHManagedCollisionModule(
        16, eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=2, history_capacity=32
    )
    graphdef, state = nnx.split(m)

    def step(state, values, valid):
        m = nnx.merge(graphdef, state)
        rows = m.forward_flat(values, valid)
        return nnx.state(m), rows, m.evict()

    args = (state, jnp.zeros((C,), jnp.int32), jnp.ones((C,), bool))
    text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "sort" in text


def test_state_flows_through_the_train_step():
    mcc, configs = _mcc()
    twin, _ = _mcc()
    model = _RemapModel(mcc, configs)
    rng = np.random.default_rng(9)
    batches = []
    for _ in range(5):
        lengths = rng.integers(0, 3, size=3 * 2).astype(np.int32)
        values = rng.integers(0, 25, size=int(lengths.sum())).astype(np.int32)
        batches.append(
            KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], values, lengths, capacities=4)
        )
    model.mcc.ensure_buffers(batches[0])
    opt = CombinedOptimizer(optax.sgd(0.1), optim.sgd(0.1))
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, lambda m, b: m(b))
    for kjt in batches:
        state, _, _ = step(state, kjt)
        twin(kjt)
    trained = train.merge_model(graphdef, state).mcc
    for t in ("t", "u"):
        a = trained.managed_collision_modules[t]
        b = twin.managed_collision_modules[t]
        for f in ("sorted_ids", "slots", "counts", "last_access", "current_iter", "evicted"):
            np.testing.assert_array_equal(getattr(a, f)[...], getattr(b, f)[...])
    assert int(trained.managed_collision_modules["t"].current_iter[...]) == 5
    assert not jax.tree.leaves(nnx.state(trained, nnx.Param))  # no dense params in the MCC
