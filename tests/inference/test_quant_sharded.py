"""Sharded quantized inference on 8 fake CPU devices equals the unsharded quantized module."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from quant_cases import assert_within, jit_call, pooled_bound
from sharding_cases import uneven_columns

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec.inference import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    ShardedQuantEmbeddingBagCollection,
    ShardedQuantEmbeddingCollection,
    quantize_inference_model,
    shard_quant_model,
)

KEYS = ["f1", "f2", "f3", "f4"]
ROWS = {"f1": 10, "f2": 50, "f3": 37, "f4": 20}
B, CAP = 3, 12


def tables(cls=jr.EmbeddingBagConfig, **kw):
    return [
        cls(name="t1", embedding_dim=8, num_embeddings=50, feature_names=["f1", "f2"]),
        cls(name="t2", embedding_dim=6, num_embeddings=37, feature_names=["f3"], **kw),
        cls(name="t3", embedding_dim=8, num_embeddings=20, feature_names=["f4"]),
        cls(name="t4", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
    ]


# t1 row-wise, t2 table-wise, t3 column-wise (own scale/bias per shard; 6 and 2
# columns, the second padded to 6), t4 data-parallel
MIXED = {
    "t1": d.row_wise(),
    "t2": d.table_wise(3),
    "t3": uneven_columns([6, 2], ranks=[6, 1]),
    "t4": d.data_parallel(),
}


def mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def batches(seed=0, weighted=False):
    """Per-device KJTs and the same ids as one global batch (and its bags per key)."""
    rng = np.random.default_rng(seed)
    local, glob = [], {k: [] for k in KEYS}
    for _ in range(8):
        bags = {k: [_bag(rng, ROWS[k]) for _ in range(B)] for k in KEYS}
        bags["f2"][1] = bags["f2"][1] + bags["f2"][1][:1] + [0]  # a duplicate id
        for k in KEYS:
            glob[k] += bags[k]
        local.append(_kjt(bags, {k: CAP for k in KEYS}))
    return local, _kjt(glob, None), glob


def _bag(rng, rows):
    return [] if rng.random() < 0.2 else rng.integers(0, rows, int(rng.integers(1, 4))).tolist()


def _kjt(bags, caps):
    lengths = [len(b) for k in KEYS for b in bags[k]]
    values = [i for k in KEYS for b in bags[k] for i in b]
    return jr.KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths, capacities=caps)


def test_sharded_ebc_equals_unsharded():
    m = mesh()
    ebc = jr.EmbeddingBagCollection(tables(pooling=jr.PoolingType.MEAN), rngs=nnx.Rngs(0))
    q = QuantEmbeddingBagCollection.from_float(ebc, "int8")
    local, glob, glob_bags = batches()
    plan = d.construct_module_sharding_plan(q, MIXED, world_size=8)
    sharded = ShardedQuantEmbeddingBagCollection(q, plan, m)
    got = np.asarray(sharded(d.shard_batch(local, m)).values())
    want = np.asarray(jit_call(q, glob).values())
    cw = slice(22, 30)  # f4 <- t3, the column-wise table
    rest = np.r_[0:22, 30:34]
    np.testing.assert_allclose(got[:, rest], want[:, rest], rtol=1e-6, atol=1e-6)  # same bytes
    # column shards: own scale/bias per shard, requantized from the dequantized rows
    t3 = np.asarray(ebc.state_dict()["embedding_bags.t3.weight"])
    bound = pooled_bound(t3, "int8", glob_bags["f4"])
    assert_within(got[:, cw], want[:, cw], 2 * bound)
    assert_within(got[:, cw], np.asarray(jit_call(ebc, glob).values())[:, cw], 2 * bound)
    with pytest.raises(TypeError, match="inference-only"):
        sharded.init_optimizer_state(None, ())


def test_shard_quant_model_from_float_and_dmp():
    """Float tables quantized shard by shard (column shards: one rounding), and a model
    from quantize_inference_model through DistributedModelParallel."""

    class Model(nnx.Module):
        def __init__(self):
            self.ebc = jr.EmbeddingBagCollection(tables(), rngs=nnx.Rngs(0))
            self.head = nnx.Linear(34, 1, rngs=nnx.Rngs(1))

        def __call__(self, kjt):
            return self.head(self.ebc(kjt).values())[:, 0]

    m = mesh()
    model = Model()
    local, glob, glob_bags = batches(1)
    batch = d.shard_batch(local, m)
    plan = d.ShardingPlan({"ebc": d.construct_module_sharding_plan(model.ebc, MIXED, world_size=8)})
    qmodel = quantize_inference_model(model, dtype="int4")
    want = np.asarray(jit_call(qmodel, glob))
    sharded = d.DistributedModelParallel(qmodel, plan, m)  # in place
    assert isinstance(sharded.ebc, ShardedQuantEmbeddingBagCollection)
    float_sharded = shard_quant_model(Model(), plan, m, dtype="int4")
    assert isinstance(float_sharded.ebc, ShardedQuantEmbeddingBagCollection)
    run = nnx.jit(lambda mod, k: mod(k))
    got, got_f = np.asarray(run(sharded, batch)), np.asarray(run(float_sharded, batch))
    emb_bound = np.concatenate(
        [
            pooled_bound(
                np.asarray(model.ebc.state_dict()[f"embedding_bags.{t}.weight"]),
                "int4",
                glob_bags[f],
            )
            for t, f in (("t1", "f1"), ("t1", "f2"), ("t2", "f3"), ("t3", "f4"), ("t4", "f1"))
        ],
        axis=1,
    )
    head = np.abs(np.asarray(model.head.kernel.get_value()))[:, 0]
    out_bound = 2 * emb_bound @ head + 1e-5
    assert_within(got, want, out_bound)
    assert_within(got_f, np.asarray(jit_call(model, glob)), out_bound / 2 + 1e-5)
    with pytest.raises(ValueError, match="not quantized collections"):
        shard_quant_model(Model(), plan, m)


def test_sharded_ec_equals_unsharded():
    m = mesh()
    ec = jr.EmbeddingCollection(tables(jr.EmbeddingConfig), rngs=nnx.Rngs(2))
    q = QuantEmbeddingCollection.from_float(ec, "int8")
    plan = d.construct_module_sharding_plan(
        q,
        {"t1": d.row_wise(), "t2": d.table_wise(5), "t3": d.table_wise(0), "t4": d.data_parallel()},
        world_size=8,
    )
    local, _, _ = batches(2)
    out = ShardedQuantEmbeddingCollection(q, plan, m)(d.shard_batch(local, m))
    for dev in (0, 5):
        want = jit_call(q, local[dev])
        for k in want:
            np.testing.assert_allclose(out[k].values()[dev], want[k].values(), rtol=1e-6, atol=1e-6)


def test_mixed_dtypes_in_one_shard_group_raise():
    cfg = tables()
    q = QuantEmbeddingBagCollection.from_float(
        jr.EmbeddingBagCollection(cfg, rngs=nnx.Rngs(0)), "int8", per_table_dtype={"t3": "int4"}
    )
    plan = d.construct_module_sharding_plan(q, {t.name: d.table_wise(0) for t in cfg}, world_size=8)
    with pytest.raises(NotImplementedError, match="different quantized dtypes"):
        ShardedQuantEmbeddingBagCollection(q, plan, mesh())
    assert jnp.dtype(q.qweights["int8_d8"].get_value().dtype) == jnp.uint8
