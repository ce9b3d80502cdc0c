"""HashZchManagedCollisionModule (a dynamic table's index) against a plain-Python index."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from zch_reference import FILL, ReferenceZch

from jaxrec.modules import (
    FrequencyAdmission,
    HashZchEvictionConfig,
    HashZchEvictionPolicyName,
    HashZchManagedCollisionModule,
    ProbabilityAdmission,
)
from jaxrec.modules import zch_index as zi
from jaxrec.sparse.ids64 import from_id_words, to_id_words

P = HashZchEvictionPolicyName
POLICIES = {
    "lru": HashZchEvictionConfig(policy=P.LRU_EVICTION),
    "lfu": HashZchEvictionConfig(policy=P.LFU_EVICTION),
    "ttl": HashZchEvictionConfig(policy=P.SINGLE_TTL_EVICTION, single_ttl=2),
}


def drifting_stream(rng, steps, batch, *, live=96, drift=12):
    """64-bit ids (high words set) from a Zipf-like window that moves each step: new ids
    arrive, old ones retire. Yields (uint64 ids, valid mask) with some padding."""
    base = np.uint64(0x1234_5678_0000_0000)
    for step in range(steps):
        lo = step * drift
        rank = np.minimum(rng.zipf(1.3, batch) - 1, live - 1)
        ids = base + np.uint64(lo) + rank.astype(np.uint64) * np.uint64(2**33 + 7)
        valid = rng.random(batch) > 0.1
        yield ids, valid


def _module(slots, ways, policy, admission, **kw):
    adm = None
    if admission and admission[0] == "freq":
        adm = FrequencyAdmission(threshold=admission[1])
    elif admission:
        adm = ProbabilityAdmission(probability=admission[1])
    return HashZchManagedCollisionModule(
        slots, ways=ways, eviction_config=POLICIES[policy], admission=adm, **kw
    )


CASES = [  # slots, ways, policy, admission
    (64, 8, "lru", None),
    (64, 16, "lfu", None),
    (48, 4, "ttl", None),
    (64, 8, "lru", ("freq", 2)),
    (32, 1, "lfu", ("freq", 3)),
    (64, 32, "lru", ("prob", 0.5)),
]


@pytest.mark.parametrize("slots,ways,policy,admission", CASES)
def test_training_calls_match_the_python_index(slots, ways, policy, admission):
    rng = np.random.default_rng(slots + ways)
    mc = _module(slots, ways, policy, admission, max_evictions=40)
    ref = ReferenceZch(
        slots, ways, policy=policy, ttl=2 if policy == "ttl" else None, admission=admission
    )
    step = jax.jit(lambda s, w, v: _train(mc.layout, s, w, v))
    state = zi.empty_state(mc.layout)
    saw_evictions = 0
    for ids, valid in drifting_stream(rng, 10, 40):
        state, rows, evicted, counts = step(state, jnp.asarray(to_id_words(ids)), valid)
        want_rows, want_evicted, want_counts = ref.train([int(i) for i in ids], list(valid))
        np.testing.assert_array_equal(np.asarray(rows), want_rows)
        got_ev = sorted(int(r) for r in np.asarray(evicted) if r != FILL)
        assert got_ev == want_evicted
        assert {k: int(v) for k, v in counts.items()} == want_counts
        assert int(state.occupancy) == ref.occupancy()
        saw_evictions += len(want_evicted)
        arrays = ref.arrays()
        np.testing.assert_array_equal(np.asarray(state.last_seen), arrays["last_seen"])
        np.testing.assert_array_equal(np.asarray(state.counts), arrays["counts"])
        held = arrays["last_seen"] >= 0
        for f in ("id_lo", "id_hi"):
            np.testing.assert_array_equal(np.asarray(getattr(state, f))[held], arrays[f][held])
    assert saw_evictions > 0 or policy == "ttl" or admission, "the stream must force evictions"


def _train(layout, state, words, valid):
    out = zi.train_step(layout, state, words[:, 0], words[:, 1], valid, max_evictions=40)
    return out.state, out.rows, out.evicted, out.counts._asdict()


def test_ttl_rejects_while_entries_live_and_evicts_expired_ones():
    mc = _module(4, 4, "ttl", None)  # one bucket, ttl 2 calls
    first = np.arange(10, 14, dtype=np.int64)
    mc.forward_flat(jnp.asarray(to_id_words(first)))
    rows = mc.forward_flat(jnp.asarray(to_id_words(np.array([99], np.int64))))
    assert int(rows[0]) == FILL and int(mc.counters()["rejected"]) == 1  # all live
    for _ in range(2):
        mc.forward_flat(jnp.asarray(to_id_words(first[:1])))  # keeps id 10 alive
    rows = mc.forward_flat(jnp.asarray(to_id_words(np.array([99], np.int64))))
    assert int(rows[0]) != FILL and int(mc.counters()["evicted"]) == 1
    held = from_id_words(np.stack([np.asarray(mc.id_lo[...]), np.asarray(mc.id_hi[...])], 1))
    assert 10 in held.tolist() and 99 in held.tolist()


def test_decisions_do_not_depend_on_the_order_of_ids():
    rng = np.random.default_rng(3)
    a, b = _module(64, 8, "lfu", ("freq", 2)), _module(64, 8, "lfu", ("freq", 2))
    for ids, valid in drifting_stream(rng, 6, 48):
        perm = rng.permutation(len(ids))
        ra = np.asarray(a.forward_flat(jnp.asarray(to_id_words(ids)), valid))
        rb = np.asarray(b.forward_flat(jnp.asarray(to_id_words(ids[perm])), valid[perm]))
        np.testing.assert_array_equal(ra[perm], rb)
    for f in ("id_lo", "id_hi", "last_seen", "counts", "sketch"):
        np.testing.assert_array_equal(
            np.asarray(getattr(a, f)[...]), np.asarray(getattr(b, f)[...])
        )


def test_eval_reads_without_changing_state():
    mc = _module(32, 8, "lru", None)
    words = jnp.asarray(to_id_words(np.array([2**40, 5, 2**40 + 1], np.int64)))
    train_rows = mc.forward_flat(words[:2])
    before = mc.state()
    rows = mc.forward_flat(words, deterministic=True)
    assert np.asarray(rows).tolist() == [*np.asarray(train_rows).tolist(), FILL]
    for x, y in zip(before, mc.state(), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_32_bit_and_x64_ids_key_like_their_words():
    ids = np.array([3, -7, 2**31 - 1], np.int64)
    a, b, c = (_module(32, 8, "lru", None) for _ in range(3))
    ra = a.forward_flat(jnp.asarray(to_id_words(ids)))
    rb = b.forward_flat(jnp.asarray(ids.astype(np.int32)))  # int32 sign-extends
    with jax.enable_x64(True):
        rc = c.forward_flat(jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(ra), np.asarray(rb))
    np.testing.assert_array_equal(np.asarray(ra), np.asarray(rc))


def test_a_rebuilt_shard_keeps_the_global_buckets_and_rows():
    full = _module(64, 8, "lru", None)
    shard = full.rebuild_with_output_id_range((32, 64))
    assert (shard.layout.bucket_offset, shard.layout.total_buckets) == (4, 8)
    ref = ReferenceZch(32, 8, total_buckets=8, bucket_offset=4, row_offset=32)
    ids = (np.uint64(2**40) + np.arange(40, dtype=np.uint64) * np.uint64(977)).astype(np.uint64)
    rows = shard.forward_flat(jnp.asarray(to_id_words(ids)))
    want, _, _ = ref.train([int(i) for i in ids])
    np.testing.assert_array_equal(np.asarray(rows), want)  # other shards' ids: FILL
    assert {int(r) for r in want if r != FILL} <= set(range(32, 64))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"zch_size": 30, "ways": 8}, "multiple of ways"),
        ({"zch_size": 32, "ways": 8, "total_num_buckets": 2}, "total_num_buckets"),
        ({"zch_size": 32, "eviction_config": "LRU"}, "HashZchEvictionConfig"),
    ],
)
def test_bad_configuration_names_the_argument(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        HashZchManagedCollisionModule(**kwargs)


def test_policy_records_check_their_parameters():
    with pytest.raises(ValueError, match="single_ttl"):
        HashZchEvictionConfig(policy=P.SINGLE_TTL_EVICTION)
    with pytest.raises(ValueError, match="threshold"):
        FrequencyAdmission(threshold=0)
    with pytest.raises(ValueError, match="probability"):
        ProbabilityAdmission(probability=1.5)


def test_sequence_collection_reads_admitted_rows_and_zeros_for_the_rest():
    from flax import nnx

    import jaxrec as jr
    from jaxrec.modules import ManagedCollisionCollection, ManagedCollisionEmbeddingCollection

    cfg = [jr.EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=32, feature_names=["f"])]
    ec = jr.EmbeddingCollection(cfg, rngs=nnx.Rngs(0), bounds_check_mode=jr.BoundsCheckMode.IGNORE)
    index = HashZchManagedCollisionModule(32, ways=8, admission=FrequencyAdmission(threshold=2))
    model = ManagedCollisionEmbeddingCollection(
        ec, ManagedCollisionCollection({"t": index}, cfg), return_remapped_features=True
    )
    first = to_id_words(np.array([2**40 + 1, 2**40 + 1, 5, 2**50, 5], np.int64))
    second = to_id_words(np.array([2**40 + 1, 7, 5, 2**50, 2**62], np.int64))
    kjts = [
        jr.KeyedJaggedTensor.from_lengths_sync(["f"], jnp.asarray(w), [2, 3])
        for w in (first, second)
    ]
    model.ensure_buffers(kjts[0])
    for kjt in kjts:  # 2**50 is admitted on its second sighting; 7 and 2**62 are not
        out, remapped = model(kjt)
    rows = np.asarray(remapped.values())[:5]
    assert [r == FILL for r in rows] == [False, True, False, False, True]
    table = np.asarray(ec.state_dict()["embeddings.t.weight"])
    got = np.asarray(out["f"].values())[:5]
    for r, v in zip(rows, got, strict=True):
        np.testing.assert_array_equal(v, 0.0 if r == FILL else table[r])
