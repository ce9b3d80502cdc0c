"""Sharded EBC on a variable batch per key (VBE): every sharding type equals the
unsharded module on the expanded batch, trains alike, and exchanges fewer bytes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sharding_cases import KEYS, PLANS, ROWS, Model, loss_fn, mesh_1d, mesh_2d

from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer
from jaxrec.sparse import KeyedJaggedTensor, dedup_features

B = 12  # samples per device
USER_KEYS = ("f1", "f2")  # deduplicated per user; f3 (MEAN) and f4 stay per sample
CAP = 64  # per key per device (plain batch)


def local_batches(rng, world=8):
    """Per device: the plain batch, its VBE twin (1-3 users: strides differ across
    devices, so shard_batch pads them) and labels."""
    plain, vbe, ys = [], [], []
    for dev in range(world):
        users = 1 + dev % 3
        user_of = rng.integers(0, users, B)
        per_user = {
            k: [np.minimum(rng.zipf(1.5, rng.integers(0, 5)), ROWS[k]) - 1 for _ in range(users)]
            for k in USER_KEYS
        }
        bags = {k: [per_user[k][u] for u in user_of] for k in USER_KEYS}
        for k in ("f3", "f4"):
            bags[k] = [rng.integers(0, ROWS[k], rng.integers(0, 4)) for _ in range(B)]
        lengths = [len(b) for k in KEYS for b in bags[k]]
        values = np.concatenate([np.concatenate(bags[k]) for k in KEYS]).astype(np.int32)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            KEYS, values, lengths, capacities={k: CAP for k in KEYS}, on_host=True
        )
        plain.append(kjt)
        caps = {k: CAP // 4 if k in USER_KEYS else CAP for k in KEYS}
        vbe.append(dedup_features(kjt, {k: user_of for k in USER_KEYS}, capacities=caps))
        ys.append(rng.normal(size=B).astype(np.float32))
    return plain, vbe, ys


def global_batch(plain, ys):
    """The devices' plain batches as one batch (the unsharded reference's input)."""
    parts = {k: [p[k] for p in plain] for k in KEYS}
    lengths = np.concatenate([np.asarray(jt.lengths()) for k in KEYS for jt in parts[k]])
    values = np.concatenate(
        [
            np.asarray(jt.values())[: int(np.asarray(jt.lengths()).sum())]
            for k in KEYS
            for jt in parts[k]
        ]
    )
    caps = {k: CAP * len(plain) for k in KEYS}
    kjt = KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths, capacities=caps)
    return kjt, jnp.asarray(np.concatenate(ys))


def sharded(name, **kwargs):
    gens, hosts = PLANS[name]
    mesh = mesh_1d() if hosts == 1 else mesh_2d()
    model = Model(rngs=nnx.Rngs(1))
    plan = d.construct_module_sharding_plan(model.ebc, gens, world_size=8, local_size=8 // hosts)
    return d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh, **kwargs), mesh


# "mixed" (row-wise, table-wise, column-wise and data-parallel tables) and "grid_shard"
# (on a 2-D mesh) train below; the other host-based types are checked forward here:
# every type is one code path over shards, a compile each (~10-40 s), so the suite
# stays short.
@pytest.mark.parametrize("name", ["table_row_wise", "table_column_wise"])
def test_forward_equals_unsharded_expanded(name):
    plain, vbe, ys = local_batches(np.random.default_rng(0))
    want = Model(rngs=nnx.Rngs(1)).ebc(global_batch(plain, ys)[0]).values()
    model, mesh = sharded(name)
    batch = d.shard_batch(vbe, mesh)
    assert batch.variable_stride_per_key()
    got = model.ebc(batch).values()
    assert got.shape == want.shape == (8 * B, 34)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mixed", "grid_shard"])
def test_training_equals_unsharded_expanded(name):
    """Row-wise Adagrad, 2 steps: losses and tables agree ("mixed": row-wise,
    table-wise, column-wise and data-parallel tables, forward and backward)."""
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    ref_graph, ref = train.init_train_state(Model(rngs=nnx.Rngs(1)), opt)
    ref_step = train.make_train_step(ref_graph, opt, loss_fn)
    model, mesh = sharded(name)
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    rng = np.random.default_rng(1)
    for _ in range(2):
        plain, vbe, ys = local_batches(rng)
        ref, want, _ = ref_step(ref, global_batch(plain, ys))
        state, loss, _ = step(state, (d.shard_batch(vbe, mesh), d.shard_batch(ys, mesh)))
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    got_tables = train.merge_model(graphdef, state).ebc.state_dict()
    for k, v in train.merge_model(ref_graph, ref).ebc.state_dict().items():
        np.testing.assert_allclose(got_tables[k], v, rtol=1e-4, atol=1e-6, err_msg=k)


def all_to_all_bytes(stablehlo: str) -> int:
    """Bytes of every all_to_all result in a lowered (StableHLO) text, per device."""
    size = {"f32": 4, "i32": 4, "ui32": 4, "bf16": 2, "f16": 2, "i8": 1, "ui8": 1, "i1": 1}
    total = 0
    for line in stablehlo.splitlines():
        if "all_to_all" not in line or "->" not in line:
            continue
        for dims, dtype in re.findall(r"tensor<((?:\d+x)*)(\w+)>", line.rsplit("->", 1)[1]):
            total += size[dtype] * int(np.prod([int(x) for x in dims.split("x") if x]))
    return total


def test_exchange_bytes_shrink_with_duplication():
    """Lowered forward of a row-wise plan: ids and pooled blocks of the user features
    travel once per user (about 6x fewer here), so the all-to-alls move fewer bytes."""
    plain, vbe, _ = local_batches(np.random.default_rng(2))
    model, mesh = sharded("row_wise", capacity=None)
    graph, state = nnx.split(model)
    run = jax.jit(lambda s, b: nnx.merge(graph, s).ebc(b).values())
    sizes = {}
    for kind, kjts in (("plain", plain), ("vbe", vbe)):
        batch = d.shard_batch(kjts, mesh)
        sizes[kind] = all_to_all_bytes(run.lower(state, batch).as_text())
    assert 0 < sizes["vbe"] < 0.7 * sizes["plain"], sizes


def test_sequence_and_ragged_refuse_vbe():
    _, vbe, _ = local_batches(np.random.default_rng(3))
    model, mesh = sharded("row_wise", exchange="ragged")
    with pytest.raises(NotImplementedError, match="exchange='ragged'"):
        model.ebc(d.shard_batch(vbe, mesh))


def test_sparse_dist_pipeline_on_vbe_batches_equals_plain_steps():
    """``TrainPipelineSparseDist`` (each VBE batch's ids sent a step ahead, with their
    per-slot bag starts) gives the plain sharded step's losses and state, bit for bit."""
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    rng = np.random.default_rng(5)
    data = [local_batches(rng)[1:] for _ in range(2)]
    model, mesh = sharded("row_wise")
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    want = []
    for vbe, ys in data:
        state, loss, _ = step(state, (d.shard_batch(vbe, mesh), d.shard_batch(ys, mesh)))
        want.append(float(loss))
    model, mesh = sharded("row_wise")
    graphdef, p_state = train.init_train_state(model, opt)
    p_step = train.make_sparse_dist_train_step(graphdef, opt, loss_fn)
    pipeline = train.TrainPipelineSparseDist(p_step, p_state, mesh=mesh)
    it, got = iter([list(zip(vbe, ys, strict=True)) for vbe, ys in data]), []
    while True:
        try:
            got.append(float(pipeline.progress(it)[0]))
        except StopIteration:
            break
    np.testing.assert_array_equal(got, want)
    for a, b in zip(jax.tree.leaves(pipeline.state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
