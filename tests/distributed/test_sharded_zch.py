"""Dynamic tables sharded by the id's hash equal the unsharded module fed the global batch:
rows, evicted rows, counters and index state; in a model under DistributedModelParallel,
losses and tables; and a checkpoint taken on 8 devices restores on 4."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sharding_cases import mesh_1d

import jaxrec as jr
import jaxrec.modules as jm
from jaxrec import checkpoint as ckpt
from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.distributed.sharded_zch import SCALAR_FIELDS, SLOT_FIELDS, is_dynamic
from jaxrec.embedding import CombinedOptimizer
from jaxrec.modules.zch_index import FILL
from jaxrec.ops import BoundsCheckMode
from jaxrec.sparse.ids64 import to_id_words

N, B, CAP = 8, 2, 6  # devices, local batch, capacity per key per device
FIELDS = (*SLOT_FIELDS, *SCALAR_FIELDS)
Policy = jm.HashZchEvictionPolicyName


def words_kjt(keys, bags, cap):
    """A KJT of 64-bit ids as id words: ``bags[key]`` lists the bags (lists of int ids)."""
    lengths = np.asarray([len(b) for k in keys for b in bags[k]], np.int32)
    ids = [i for k in keys for b in bags[k] for i in b]
    idx = jr.KeyedJaggedTensor.from_lengths_sync(
        keys, np.arange(len(ids), dtype=np.int32), lengths, capacities=cap
    )
    words = to_id_words(np.asarray(ids, np.int64).reshape(-1))
    pos = np.clip(np.asarray(idx.values()), 0, max(len(ids) - 1, 0))
    values = words[pos] if len(ids) else np.zeros((pos.shape[0], 2), np.uint32)
    return jr.KeyedJaggedTensor.from_parts(
        keys,
        jnp.asarray(values),
        idx.lengths(),
        capacities=idx.capacity_per_key(),
        stride=idx.stride(),
    )


def drifting_id(i: int) -> int:
    """Id ``i`` of the stream: high words 1..5 (and one negative id in eight)."""
    v = ((i % 5 + 1) << 32) | (i * 2654435761 % 2**32)
    return -v if i % 8 == 3 else v


def batches(rng, step, keys, world=N, b=B):
    """``world`` local batches and their global batch; ids from a window that drifts by
    ``4 * step`` (new ids each call, old ones retire), repeated ids in most bags."""
    local, glob = [], {k: [] for k in keys}
    for _ in range(world):
        bags = {}
        for k in keys:
            window = (4 * step, 4 * step + 36)
            bags[k] = [
                [drifting_id(int(i)) for i in rng.integers(*window, rng.integers(0, 4))]
                for _ in range(b)
            ]
            glob[k] += bags[k]
        local.append(words_kjt(keys, bags, CAP * b // B))
    return local, words_kjt(keys, glob, world * CAP * b // B)


def rows_by_key(kjt):
    """``{key: valid rows}`` of a local or stacked KJT (devices concatenated in order)."""
    values, lengths = np.asarray(kjt.values()), np.asarray(kjt.lengths())
    if values.ndim == 1:
        values, lengths = values[None], lengths[None]
    keys, offs, out = kjt.keys(), kjt.capacity_offsets(), {}
    for i, k in enumerate(keys):
        per = lengths.reshape(len(values), len(keys), -1)[:, i].sum(axis=1)
        out[k] = np.concatenate([values[r, offs[i] : offs[i] + per[r]] for r in range(len(values))])
    return out


def assert_same_index(sharded_table, module):
    for f in FIELDS:
        np.testing.assert_array_equal(
            np.asarray(getattr(sharded_table, f)[...]), np.asarray(getattr(module, f)[...]), f
        )


def _collection():
    configs = [
        jr.EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=z, feature_names=f)
        for n, z, f in (("t", 64, ["a", "b"]), ("u", 32, ["c"]), ("v", 32, ["d"]))
    ]
    modules = {
        "t": jm.HashZchManagedCollisionModule(
            64, ways=4, admission=jm.FrequencyAdmission(threshold=2)
        ),  # LRU
        "u": jm.HashZchManagedCollisionModule(
            32,
            ways=2,
            eviction_config=jm.HashZchEvictionConfig(policy=Policy.LFU_EVICTION),
            input_hash_seed=7,
        ),
        "v": jm.HashZchManagedCollisionModule(
            32,
            ways=4,
            eviction_config=jm.HashZchEvictionConfig(
                policy=Policy.SINGLE_TTL_EVICTION, single_ttl=1
            ),
        ),
    }
    return jm.ManagedCollisionCollection(modules, configs), configs


def test_sharded_index_equals_unsharded_module_on_the_global_batch():
    mesh = mesh_1d()
    ref, configs = _collection()
    sharded = d.ShardedHashZchCollection(_collection()[0], mesh)
    keys = ["a", "b", "c", "d"]
    call = nnx.jit(lambda m, f, det: m(f, deterministic=det), static_argnums=2)
    rng = np.random.default_rng(0)
    evicted = dict.fromkeys(sharded.managed_collision_modules, 0)
    for step in range(6):
        local, glob = batches(rng, step, keys)
        stacked = d.shard_batch(local, mesh)
        if step == 0:
            ref.ensure_buffers(glob)
            sharded.ensure_buffers(stacked)
        for det in (False, True) if step in (2, 5) else (False,):  # eval calls too
            want = rows_by_key(call(ref, glob, det))
            got = rows_by_key(sharded(stacked, deterministic=det))
            for k in keys:
                np.testing.assert_array_equal(got[k], want[k], err_msg=f"{step=} {det=} {k}")
        for c in configs:
            table, module = (
                sharded.managed_collision_modules[c.name],
                ref.managed_collision_modules[c.name],
            )
            assert _rows(table.evict()) == _rows(module.evict())  # packed vs in id order
            got, want = sharded.counters()[c.name], module.counters()
            assert {k: int(v) for k, v in got.items()} == {k: int(v) for k, v in want.items()}
            assert int(sharded.open_slots()[c.name]) == int(module.open_slots())
            assert_same_index(table, module)
            evicted[c.name] += int(got["evicted"])
    assert all(evicted.values()), evicted  # every policy evicted
    table = sharded.managed_collision_modules["t"]
    assert table.id_lo[...].sharding.spec == jax.sharding.PartitionSpec(("x",))
    assert table.sketch.shape == (64,)  # FrequencyAdmission's sketch, sharded with the slots


def test_bad_collections_say_what_to_fix():
    mesh = mesh_1d()
    cfg = [jr.EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=24, feature_names=["a"])]
    odd = jm.ManagedCollisionCollection({"t": jm.HashZchManagedCollisionModule(24, ways=4)}, cfg)
    with pytest.raises(ValueError, match="must split evenly over the 8 shards"):
        d.ShardedHashZchCollection(odd, mesh)
    mch = jm.MCHManagedCollisionModule(
        24, eviction_policy=jm.LFU_EvictionPolicy(), eviction_interval=1
    )
    with pytest.raises(TypeError, match="dynamic tables only"):
        d.ShardedHashZchCollection(jm.ManagedCollisionCollection({"t": mch}, cfg), mesh)
    two = [dataclasses.replace(cfg[0], name="u", feature_names=["b"]), *cfg]
    mixed = {"t": mch, "u": jm.HashZchManagedCollisionModule(24, ways=4)}
    with pytest.raises(ValueError, match="put them in two collections"):
        is_dynamic(jm.ManagedCollisionCollection(mixed, two))  # DMP asks this first
    model = Model()
    plan = d.construct_module_sharding_plan(
        model.mc.embedding_bag_collection, {"t": d.table_wise(0), "u": d.row_wise()}, world_size=8
    )
    with pytest.raises(ValueError, match="plan the table row-wise"):
        d.DistributedModelParallel(model, d.ShardingPlan({"mc": plan}), mesh)


# ----- a model under DistributedModelParallel -----
OPT = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.2))
MODEL_KEYS = ["a", "b", "c"]


class Model(nnx.Module):
    """A dynamic-table EBC (frequency admission + LRU, and LFU) and a dense head."""

    def __init__(self):
        tables = [
            jr.EmbeddingBagConfig(
                name="t", embedding_dim=4, num_embeddings=64, feature_names=["a", "b"]
            ),
            jr.EmbeddingBagConfig(
                name="u", embedding_dim=4, num_embeddings=32, feature_names=["c"]
            ),
        ]
        lfu = jm.HashZchEvictionConfig(policy=Policy.LFU_EVICTION)
        mcc = jm.ManagedCollisionCollection(
            {
                "t": jm.HashZchManagedCollisionModule(
                    64, ways=4, admission=jm.FrequencyAdmission(threshold=2), max_evictions=48
                ),
                "u": jm.HashZchManagedCollisionModule(
                    32, ways=2, eviction_config=lfu, max_evictions=32
                ),
            },
            tables,
        )
        ebc = jr.EmbeddingBagCollection(
            tables, bounds_check_mode=BoundsCheckMode.IGNORE, rngs=nnx.Rngs(0)
        )
        self.mc = jm.ManagedCollisionEmbeddingBagCollection(ebc, mcc, rngs=nnx.Rngs(1))
        self.head = nnx.Linear(12, 1, rngs=nnx.Rngs(2))

    def __call__(self, kjt):
        return jnp.tanh(self.head(self.mc(kjt)[0].values())[:, 0])


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def sharded_model(mesh):
    model = Model()
    plan = d.construct_module_sharding_plan(
        model.mc.embedding_bag_collection,
        {"t": d.row_wise(), "u": d.row_wise()},
        world_size=mesh.size,
    )
    model = d.DistributedModelParallel(model, d.ShardingPlan({"mc": plan}), mesh)
    assert isinstance(model.mc.managed_collision_collection, d.ShardedHashZchCollection)
    graphdef, state = train.init_train_state(model, OPT)
    return graphdef, state, train.make_train_step(graphdef, OPT, loss_fn)


def data(steps, world, first=0, seed=1):
    """``(local batches, global batch)`` per step; every device's local batch is
    ``8 // world`` times the 8-device one, so the global batch has one shape."""
    rng = np.random.default_rng(seed + first)
    out = []
    for s in range(first, first + steps):
        local, glob = batches(rng, s, MODEL_KEYS, world, B * N // world)
        ys = rng.normal(size=(world, B * N // world)).astype(np.float32)
        out.append(
            ([(k, y) for k, y in zip(local, ys, strict=True)], (glob, jnp.asarray(ys.reshape(-1))))
        )
    return out


def assert_same_model(model, ref_model, tol=1e-6):
    coll, ref_coll = model.mc.embedding_bag_collection, ref_model.mc.embedding_bag_collection
    want = ref_coll.state_dict()
    for k, v in coll.state_dict().items():
        np.testing.assert_allclose(v, want[k], rtol=1e-5, atol=tol, err_msg=k)
    for name, module in ref_model.mc.managed_collision_collection.managed_collision_modules.items():
        assert_same_index(
            model.mc.managed_collision_collection.managed_collision_modules[name], module
        )
    got, want = nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=tol)


def test_dmp_trains_as_unsharded_and_restores_on_4_devices(tmp_path):
    """(b) 3 steps on 8 devices equal unsharded training on the global batches (losses,
    tables with their resets, index state); (c) a checkpoint taken then restores on 4
    devices and 2 more steps there still equal the uninterrupted unsharded run."""
    before, after = data(3, 8), data(2, 4, first=3)
    graphdef, ref = train.init_train_state(Model(), OPT)
    ref = jax.tree.map(jnp.copy, ref)  # the module's zero scalars share a buffer (donated twice)
    ref_step = train.make_train_step(graphdef, OPT, loss_fn)
    ref_losses = []
    for _, glob in before + after:
        ref, loss, _ = ref_step(ref, glob)
        ref_losses.append(float(loss))
        if len(ref_losses) == len(before):
            ref_at_save = jax.tree.map(jnp.copy, ref)

    mesh8 = mesh_1d()
    sgraph, state, step = sharded_model(mesh8)
    for i, (local, _) in enumerate(before):
        state, loss, _ = step(state, d.shard_batch(local, mesh8))
        np.testing.assert_allclose(float(loss), ref_losses[i], rtol=1e-6, atol=1e-7)
    model = train.merge_model(sgraph, state)
    ref_model = train.merge_model(graphdef, ref_at_save)
    evicted = ref_model.mc.evict()
    assert any((np.asarray(v) < 64).any() for v in evicted.values())  # the last step reset rows
    for name, rows in model.mc.evict().items():
        assert _rows(rows) == _rows(evicted[name])
    assert_same_model(model, ref_model)
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(len(before), sgraph, OPT, state)

    mesh4 = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    graph4, target, step4 = sharded_model(mesh4)
    with ckpt.CheckpointManager(tmp_path) as mgr:
        state4 = mgr.restore(graph4, OPT, target)
    table = state4.rest["mc"]["_managed_collision_collection"]["managed_collision_modules"]["t"]
    assert table["id_lo"].get_value().sharding.mesh.size == 4
    for i, (local, _) in enumerate(after):
        state4, loss, _ = step4(state4, d.shard_batch(local, mesh4))
        np.testing.assert_allclose(float(loss), ref_losses[len(before) + i], rtol=1e-6, atol=1e-7)
    assert_same_model(train.merge_model(graph4, state4), train.merge_model(graphdef, ref))


def _rows(evicted) -> list[int]:
    """The evicted rows (sorted, fill dropped): the set a reset acts on."""
    return sorted(int(r) for r in np.asarray(evicted).ravel() if r != FILL)
