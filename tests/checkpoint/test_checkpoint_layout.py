"""Logical <-> physical conversion of tables and sparse optimizer state, under every plan."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from checkpoint_cases import (
    PLANS,
    assert_equal,
    batch,
    build,
    build_plan,
    host,
    loss_fn,
    mesh_1d,
    samples,
    tables,
)
from flax import nnx

import jaxrec as jr
from jaxrec import checkpoint as ckpt
from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

# momentum1 is element-wise [rows, dim], momentum2 row-wise [rows]: both kinds of field.
OPT = CombinedOptimizer(optax.sgd(0.1), optim.partial_rowwise_adam(0.05))


def filled(logical, seed, constant_rows=False):
    """``logical`` with random tables and state: momentum1 = weight, count 7.

    With ``constant_rows`` every column of a row holds the same value, which
    momentum2 (row-wise) holds too.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for key, entry in logical.tables.items():
        n, dim = entry["weight"].shape
        v = rng.normal(size=n).astype(np.float32)
        w = np.repeat(v[:, None], dim, 1) if constant_rows else rng.normal(size=(n, dim))
        w = w.astype(np.float32)
        out[key] = {"weight": w, "momentum1": w.copy(), "momentum2": v, "count": np.int32(7)}
    return logical._replace(tables=out)


@pytest.mark.parametrize("name", [*PLANS, "unsharded"])
def test_place_and_read_back(name):
    """Every plan: logical -> physical -> logical is exact; the physical weights are
    what the collection's own ``load_state_dict`` builds; element-wise state uses the
    weights' layout; row-wise state is copied into every column shard of a row."""
    if name == "unsharded":
        graphdef, state, _ = build("unsharded", OPT)
    else:
        graphdef, state = build_plan(name, OPT)
    logical = filled(ckpt.logical_state(graphdef, OPT, state), seed=0)
    placed = ckpt.place_state(graphdef, OPT, state, logical)
    assert_equal(host(ckpt.logical_state(graphdef, OPT, placed)), host(logical))

    weights = dict(placed.tables["ebc"]["weights"].items())
    sparse = placed.opt_state.sparse
    for buf, w in weights.items():
        assert w.sharding == state.tables["ebc"]["weights"][buf].get_value().sharding
        np.testing.assert_array_equal(sparse[f"ebc/{buf}"].momentum1, w.get_value())
        assert int(sparse[f"ebc/{buf}"].count) == 7
    model = train.merge_model(graphdef, state)  # the collection's own placement, for reference
    model.ebc.load_state_dict(
        {
            f"embedding_bags.{k.split('.')[-1]}.weight": e["weight"]
            for k, e in logical.tables.items()
        }
    )
    for buf, w in weights.items():
        np.testing.assert_array_equal(w.get_value(), model.ebc.weights[buf].get_value(), buf)

    const = filled(logical, seed=1, constant_rows=True)
    placed = ckpt.place_state(graphdef, OPT, state, const)
    for buf, w in placed.tables["ebc"]["weights"].items():
        np.testing.assert_array_equal(
            placed.opt_state.sparse[f"ebc/{buf}"].momentum2, w.get_value()[:, 0], buf
        )


def test_tables_sharing_a_state_need_one_count():
    graphdef, state, _ = build("unsharded", OPT)  # t1 and t3 share the 8-wide buffer
    logical = filled(ckpt.logical_state(graphdef, OPT, state), seed=0)
    logical.tables["ebc.embedding_bags.t3"]["count"] = np.int32(4)
    t1, t3 = "'ebc.embedding_bags.t1'", "'ebc.embedding_bags.t3'"
    with pytest.raises(
        ValueError,
        match=rf"tables \[{t1}, {t3}\] share one optimizer state.*"
        rf"different optimizer step counts \{{{t1}: 7, {t3}: 4\}}",
    ):
        ckpt.place_state(graphdef, OPT, state, logical)


def test_per_table_optimizers_round_trip(tmp_path):
    """t1 and t3 share a stacked buffer but not an optimizer (two subgroup states)."""
    opt = CombinedOptimizer(
        optax.adam(0.01), optim.rowwise_adagrad(0.1), per_table={"t3": optim.adam(0.05)}
    )
    graphdef, state, _ = build("unsharded", opt)
    assert set(state.opt_state.sparse) == {
        "ebc/fp32_d8",
        "ebc/fp32_d8#1",
        "ebc/fp32_d6",
        "ebc/fp32_d4",
    }
    step = train.make_train_step(graphdef, opt, loss_fn)
    data = [samples(10 + i) for i in range(3)]
    for i in range(2):
        state, _, _ = step(state, batch(data[i], None))

    # Independently: t1 is rows [0, 50) of the d8 buffer and of subgroup 0's state,
    # t3 rows [50, 70) of the buffer and rows [0, 20) of subgroup 1's (Adam) state.
    logical = ckpt.logical_state(graphdef, opt, state)
    w = np.asarray(state.tables["ebc"]["weights"]["fp32_d8"].get_value())
    t1, t3 = logical.tables["ebc.embedding_bags.t1"], logical.tables["ebc.embedding_bags.t3"]
    np.testing.assert_array_equal(t1["weight"], w[:50])
    np.testing.assert_array_equal(t3["weight"], w[50:])
    np.testing.assert_array_equal(t1["momentum1"], state.opt_state.sparse["ebc/fp32_d8"].momentum1)
    adam_state = state.opt_state.sparse["ebc/fp32_d8#1"]
    np.testing.assert_array_equal(t3["momentum1"], adam_state.momentum1)
    np.testing.assert_array_equal(t3["momentum2"], adam_state.momentum2)
    assert sorted(t1) == ["count", "momentum1", "weight"] and int(t3["count"]) == 2
    assert t1["momentum1"].shape == (50,) and t3["momentum2"].shape == (20, 8)
    assert np.abs(adam_state.momentum1).sum() > 0 and np.abs(t1["momentum1"]).sum() > 0

    saved = host(logical)
    with ckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(2, graphdef, opt, state)
        state, _, _ = step(state, batch(data[2], None))
        final = host(ckpt.logical_state(graphdef, opt, state))

        _, target, _ = build("unsharded", opt)
        restored = mgr.restore(graphdef, opt, target)
        assert_equal(host(ckpt.logical_state(graphdef, opt, restored)), saved)
        restored, _, _ = step(restored, batch(data[2], None))
        assert_equal(host(ckpt.logical_state(graphdef, opt, restored)), final)

        # Sharded: t1 and t3 in different buffers (t3 column-wise in 4-wide shards).
        plan = {
            "t1": d.row_wise(),
            "t2": d.row_wise(),
            "t3": d.column_wise([1, 2]),
            "t4": d.data_parallel(),
        }
        graphdef, target, _ = build("row_wise_8", opt, plan=plan)
        restored = mgr.restore(graphdef, opt, target, step=2)
        assert_equal(host(ckpt.logical_state(graphdef, opt, restored)), saved)


class Sparse(nnx.Module):
    def __init__(self):
        self.ebc = jr.EmbeddingBagCollection(tables(), rngs=nnx.Rngs(0))
        seq = [  # the same table names as the EBC's, in another collection
            jr.EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=30, feature_names=["f1"]),
            jr.EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=9, feature_names=["f2"]),
        ]
        self.ec = jr.EmbeddingCollection(seq, rngs=nnx.Rngs(3))


class TwoCollections(nnx.Module):
    def __init__(self, *, rngs):
        self.sparse = Sparse()
        self.head = nnx.Linear(4, 1, rngs=rngs)


def test_nested_pooled_and_sequence_collections(tmp_path):
    """Tables are keyed by module path and prefix; an EmbeddingCollection reshards too."""
    model = TwoCollections(rngs=nnx.Rngs(1))
    gens = {
        "sparse.ebc": PLANS["mixed"][0],
        "sparse.ec": {"t1": d.row_wise(), "t2": d.column_wise([6, 2])},
    }
    plan = d.ShardingPlan(
        {
            k: d.construct_module_sharding_plan(getattr(model.sparse, k[7:]), g, world_size=8)
            for k, g in gens.items()
        }
    )
    model = d.DistributedModelParallel(model, plan, mesh_1d())
    graphdef, state = train.init_train_state(model, OPT)
    logical = filled(ckpt.logical_state(graphdef, OPT, state), seed=2)
    assert sorted(logical.tables) == [
        *(f"sparse.ebc.embedding_bags.t{i}" for i in range(1, 5)),
        "sparse.ec.embeddings.t1",
        "sparse.ec.embeddings.t2",
    ]
    state = ckpt.place_state(graphdef, OPT, state, logical)
    with ckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, graphdef, OPT, state)
        graphdef, target = train.init_train_state(TwoCollections(rngs=nnx.Rngs(1)), OPT)
        restored = mgr.restore(graphdef, OPT, target)
    assert_equal(host(ckpt.logical_state(graphdef, OPT, restored)), host(logical))
    ec = train.merge_model(graphdef, restored).sparse.ec
    np.testing.assert_array_equal(
        ec.state_dict()["embeddings.t2.weight"], logical.tables["sparse.ec.embeddings.t2"]["weight"]
    )


@pytest.mark.parametrize(
    "saved_under, restored_under, async_save",
    [
        ("column_wise", "mixed", False),
        ("mixed", "column_wise", True),
        ("row_wise", "unsharded", True),
    ],
)
@pytest.mark.parametrize("host_views", [True, False], ids=["views", "device_windows"])
def test_streaming_in_small_windows_across_plans(
    tmp_path, monkeypatch, saved_under, restored_under, async_save, host_views
):
    """Chunks of a few rows and staging windows of a few chunks: pieces span many
    chunks, windows end mid-piece and clamp at the end of a shard, column shards are
    read back into other column splits, an async save's host copy skips padding rows;
    the result is exact. Shards are read through host views (CPU devices) or sliced on
    the device (as on GPUs)."""
    from jaxrec.checkpoint import store

    monkeypatch.setattr(store, "CHUNK_BYTES", 64)  # 2 rows of 8 floats

    def state_of(name):
        return build("unsharded", OPT)[:2] if name == "unsharded" else build_plan(name, OPT)

    graphdef, state = state_of(saved_under)
    logical = filled(ckpt.logical_state(graphdef, OPT, state), seed=3, constant_rows=True)
    state = ckpt.place_state(graphdef, OPT, state, logical)
    with ckpt.CheckpointManager(
        tmp_path, async_save=async_save, staging_bytes=200, host_views=host_views
    ) as mgr:
        mgr.save(1, graphdef, OPT, state)
        zero = jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t), donate_argnums=0)
        zero((state.tables, state.opt_state.sparse))  # a donating step overwrites them
        graphdef, target = state_of(restored_under)
        restored = mgr.restore(graphdef, OPT, target)
    assert_equal(host(ckpt.logical_state(graphdef, OPT, restored)), host(logical))
    chunks = list(tmp_path.glob("1/tables/*/weight/*/c/*/*"))
    assert len(chunks) > 2 * len(logical.tables)  # the pieces really were cut into chunks
