"""Row-wise sharded managed collision against N unsharded modules, one per input bucket."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from sharding_cases import mesh_1d

import jaxrec as jr
from jaxrec.distributed import shard_batch
from jaxrec.distributed.sharded_mc import STATE_FIELDS, ShardedManagedCollisionCollection
from jaxrec.modules import (
    EVICTION_FILL,
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
    hash_ids,
)

N, B, CAP = 8, 2, 5  # devices, local batch, capacity per key per device
KEYS = ["a", "b", "c"]


def _collection():
    configs = [
        jr.EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=32, feature_names=KEYS[:2]),
        jr.EmbeddingBagConfig(name="u", embedding_dim=4, num_embeddings=24, feature_names=["c"]),
    ]
    modules = {
        "t": MCHManagedCollisionModule(
            32, eviction_policy=LFU_EvictionPolicy(), eviction_interval=2, input_hash_size=80
        ),
        "u": MCHManagedCollisionModule(
            24,
            eviction_policy=DistanceLFU_EvictionPolicy(),
            eviction_interval=3,
            input_hash_func=hash_ids,
        ),
    }
    return ManagedCollisionCollection(modules, configs), configs


def _local_batch(rng):
    lengths = rng.integers(0, 3, size=len(KEYS) * B).astype(np.int32)
    values = (rng.zipf(1.5, size=int(lengths.sum())) * 7 % 90 - 3).astype(np.int32)  # some < 0
    return jr.KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths, capacities=CAP)


@jax.jit
def _shard_step(graphdef, state, keys):
    """One reference shard: profile all the keys it received, then remap them.

    Every shard of a table shares one graphdef (shard 0's): one compile per table.
    """
    m = nnx.merge(graphdef, state)
    m.profile_keys(keys)
    return m.remap_keys(keys), m.evict(), nnx.state(m)


@nnx.jit
def _keys(m, values, valid):
    return m.keys(values, valid)


def test_sharded_equals_unsharded_modules_per_input_bucket():
    mesh = mesh_1d()
    mcc, configs = _collection()
    smcc = ShardedManagedCollisionCollection(mcc, mesh)
    ref = {}
    for c in configs:
        mc = mcc.managed_collision_modules[c.name]
        blk = mc.zch_size // N
        ref[c.name] = [mc.rebuild_with_output_id_range((k * blk, (k + 1) * blk)) for k in range(N)]
        for m in ref[c.name]:
            m.ensure_buffers(N * CAP * len(c.feature_names))
    rng = np.random.default_rng(0)
    jitted = nnx.jit(lambda m, f: m(f))
    for step in range(7):
        local = [_local_batch(rng) for _ in range(N)]
        stacked = shard_batch(local, mesh)
        out = jitted(smcc, stacked) if step == 3 else smcc(stacked)  # traced and eager paths
        got = np.asarray(out.values())
        for c in configs:
            mc = mcc.managed_collision_modules[c.name]
            width = CAP * len(c.feature_names)
            block = -(-mc.input_hash_size // N)
            keys, buckets = [], []
            for kjt in local:
                flat = jnp.concatenate([kjt[f].values() for f in c.feature_names])
                ok = jnp.concatenate([kjt[f].valid_mask() for f in c.feature_names])
                k = np.asarray(_keys(mc, flat, ok)).astype(np.int64)
                keys.append(k)
                buckets.append(np.where(k == 2**32 - 1, -1, np.minimum(k // block, N - 1)))
            want = [np.full(width, mc.zch_size - 1) for _ in range(N)]
            evicted = np.asarray(smcc.evict()[c.name])
            for s, m in enumerate(ref[c.name]):
                sent = np.concatenate([k[b == s] for k, b in zip(keys, buckets, strict=True)])
                padded = np.full(N * width, 2**32 - 1, np.uint32)
                padded[: sent.size] = sent
                graphdef = nnx.graphdef(ref[c.name][0])
                rows, ev, new_state = _shard_step(graphdef, nnx.state(m), jnp.asarray(padded))
                nnx.update(m, new_state)
                rows, at = np.asarray(rows), 0
                for d in range(N):
                    n = int((buckets[d] == s).sum())
                    want[d][buckets[d] == s] = rows[at : at + n]
                    at += n
                np.testing.assert_array_equal(evicted[s], ev)
                shard = smcc.shard_state(c.name, s)
                for f in STATE_FIELDS:
                    np.testing.assert_array_equal(shard[f], getattr(m, f)[...])
            for d, kjt in enumerate(local):
                starts = kjt.capacity_offsets()
                for j, f in enumerate(c.feature_names):
                    i = KEYS.index(f)
                    valid = np.asarray(kjt[f].valid_mask())
                    part = got[d, starts[i] : starts[i + 1]]
                    np.testing.assert_array_equal(
                        part[valid], want[d][j * CAP : (j + 1) * CAP][valid]
                    )
    evicted = np.asarray(smcc.evict()["t"])
    blk = 32 // N
    for s in range(N):  # each shard's evictions lie in its own row block
        e = evicted[s][evicted[s] != EVICTION_FILL]
        assert ((e >= s * blk) & (e < (s + 1) * blk)).all()
    assert int(smcc.state["t"]["current_iter"][...][0]) == 7
    assert (np.asarray(smcc.open_slots()["u"]) < 2).any()  # hashed ids spread, tables fill


def test_eval_mode_and_bad_configs():
    mesh = mesh_1d()
    mcc, _ = _collection()
    smcc = ShardedManagedCollisionCollection(mcc, mesh)
    stacked = shard_batch([_local_batch(np.random.default_rng(d)) for d in range(N)], mesh)
    smcc.eval()
    smcc(stacked)
    assert int(jnp.sum(smcc.state["t"]["current_iter"][...])) == 0
    smcc.train()
    smcc(stacked, deterministic=True)
    assert int(jnp.sum(smcc.state["t"]["current_iter"][...])) == 0
    assert (np.asarray(smcc.open_slots()["t"]) == 3).all()
    with pytest.raises(ValueError, match="stacked per device"):
        smcc(jr.KeyedJaggedTensor(KEYS, [1], lengths=[1, 0, 0]))
    lfu = LFU_EvictionPolicy()
    cfg = [jr.EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=20)]
    bad = ManagedCollisionCollection(
        {"t": MCHManagedCollisionModule(20, eviction_policy=lfu, eviction_interval=1)}, cfg
    )
    with pytest.raises(ValueError, match="multiple of the 8 shards"):
        ShardedManagedCollisionCollection(bad, mesh)
    with pytest.raises(TypeError, match="ManagedCollisionCollection"):
        ShardedManagedCollisionCollection({"t": None}, mesh)
