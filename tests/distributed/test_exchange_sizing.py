"""The exchange's fast path sized by input statistics, QComms, and their compiled programs."""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sharding_cases import KEYS, PLANS, Model, batches, loss_fn, mesh_1d
from test_sharded_ebc import sharded_model

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.distributed.capacity import expected_load, fast_path_capacity, group_capacity
from jaxrec.embedding import CombinedOptimizer


def test_fast_path_capacity_formula():
    assert fast_path_capacity(5120.0, natural=40960) == math.ceil(1.1 * 5120 + 3 * math.sqrt(5120))
    assert fast_path_capacity(5120.0, natural=5000) == 5000  # never above the natural payload
    assert fast_path_capacity(0.0, natural=10) == 1
    with pytest.raises(ValueError, match="capacity_factor must be >= 1"):
        fast_path_capacity(10.0, natural=100, factor=0.5)


def test_expected_load_counts_each_shards_share_of_its_features_ids():
    """Row-wise t1 (50 rows over 8 ranks: 7, 7, ..., 1) reads f1 and f2; by hand."""
    model, _ = sharded_model("row_wise")
    layout = model.ebc.layout
    (g8,) = [g for g in layout.groups if g.ncols == 8]  # t1 and t3 (t3 on ranks 2 and 5)
    caps = {k: 16 for k in KEYS}
    pf = {"f1": 2.0, "f2": 3.0}  # f4 (t3) has none: its whole capacity counts
    want = []
    for slots in g8.slots:
        load = 0.0
        for s in slots:
            mean = min(16, 4 * pf[s.key]) if s.key in pf else 16
            load += mean * s.nrows / s.table_rows
        want.append(load)
    got = expected_load(caps, 4, g8.slots, pf)
    assert got == pytest.approx(max(want))
    c = group_capacity(caps, 4, g8, pooling_factors=pf)
    assert c == fast_path_capacity(max(want), natural=48)
    assert group_capacity(caps, 4, g8, capacity=1000) == 48  # lowered to the natural payload
    assert group_capacity(caps, 4, g8, capacity={g8.name: 5}) == 5


def test_collection_capacities_follow_pooling_factors():
    pf = {"f1": 1.0, "f2": 1.0, "f3": 1.0, "f4": 1.0}
    with_stats, _ = sharded_model("table_wise", pooling_factors=pf)
    without, _ = sharded_model("table_wise")
    kjt = batches(np.random.default_rng(0))[0][0][0]
    small, big = with_stats.ebc.capacities(kjt), without.ebc.capacities(kjt)
    assert set(small) == set(big) == {g.name for g in with_stats.ebc.layout.groups}
    assert all(small[g] < big[g] for g in small), (small, big)


def test_bad_sizing_arguments_name_the_fix():
    with pytest.raises(ValueError, match="pooling_factors name unknown features \\['nope'\\]"):
        sharded_model("row_wise", pooling_factors={"nope": 2.0})
    with pytest.raises(ValueError, match="must be positive"):
        sharded_model("row_wise", pooling_factors={"f1": 0.0})
    with pytest.raises(ValueError, match="unknown width groups \\['fp32_c99'\\]"):
        sharded_model("row_wise", capacity={"fp32_c99": 4})
    with pytest.raises(ValueError, match="capacity must be None"):
        sharded_model("row_wise", capacity=0)
    with pytest.raises(ValueError, match="overflow must be one of"):
        sharded_model("row_wise", overflow="drop")
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        d.QCommsConfig(forward_precision="fp8")


def _step_program(name, **kwargs):
    opt = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.1))
    model, mesh = sharded_model(name, **kwargs)
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    local, _ = batches(np.random.default_rng(0))
    return step.lower(state, d.shard_batch(local, mesh)).compile()


def test_statistics_sized_buffers_are_smaller_in_the_compiled_step():
    """Row-wise: the fast path holds the expected ids per destination (about 1/8 of a
    feature's ids here), not every id; XLA's own temporaries show it."""
    pf = {k: 1.0 for k in KEYS}
    natural = _step_program("row_wise", capacity=10**6)  # lowered to the natural payload
    sized = _step_program("row_wise", pooling_factors=pf)
    t_nat = natural.memory_analysis().temp_size_in_bytes
    t_sized = sized.memory_analysis().temp_size_in_bytes
    assert t_sized < 0.6 * t_nat, (t_sized, t_nat)


def test_qcomms_payloads_travel_in_half_precision_and_train_close():
    """fp16 blocks forward and bf16 gradients backward (TorchRec's usual pair): the
    collectives carry them, and one SGD step moves the tables within their rounding of
    the float32 step. Then fp16 gradients with a loss scale (their range is small)."""
    gens, _ = PLANS["mixed"]
    opt = CombinedOptimizer(optax.sgd(0.1), optim.sgd(0.5))
    configs = {
        "fp32": None,
        "fp16_bf16": d.QCommsConfig(forward_precision="fp16", backward_precision="bf16"),
        "fp16_scaled": d.QCommsConfig(
            forward_precision="fp16", backward_precision="fp16", backward_loss_scale=1024.0
        ),
    }
    local, _ = batches(np.random.default_rng(0))
    out = {}
    for name, qcomms in configs.items():
        model = Model(rngs=nnx.Rngs(1))
        plan = d.construct_module_sharding_plan(model.ebc, gens, world_size=8)
        model = d.DistributedModelParallel(
            model, d.ShardingPlan({"ebc": plan}), mesh_1d(), qcomms=qcomms
        )
        before = {k: np.asarray(v) for k, v in model.ebc.state_dict().items()}
        graphdef, state = train.init_train_state(model, opt)
        step = train.make_train_step(graphdef, opt, loss_fn)
        batch = d.shard_batch(local, model.ebc.mesh)
        text = step.lower(state, batch).as_text()  # XLA:CPU widens bf16 collectives
        state, loss, _ = step(state, batch)
        after = train.merge_model(graphdef, state).ebc.state_dict()
        moved = {k: np.asarray(v) - before[k] for k, v in after.items()}
        a2a = [ln for ln in text.splitlines() if "all_to_all" in ln]
        out[name] = (a2a, float(loss), moved)
    assert not any("xf16>" in ln or "xbf16>" in ln for ln in out["fp32"][0])
    assert any("xf16>" in ln for ln in out["fp16_bf16"][0])  # pooled blocks forward
    assert any("xbf16>" in ln for ln in out["fp16_bf16"][0])  # gradients backward
    for name, eps in (("fp16_bf16", 2.0**-7), ("fp16_scaled", 2.0**-10)):
        np.testing.assert_allclose(out[name][1], out["fp32"][1], rtol=8 * eps)
        for k, want in out["fp32"][2].items():
            assert np.abs(want).max() > 0, k  # the step moved every table
            np.testing.assert_allclose(
                out[name][2][k], want, rtol=0, atol=8 * eps * np.abs(want).max(), err_msg=k
            )


def _skewed(kjt, rng):
    """The batch with every id in its table's first rows: row-wise rank 0 gets them all."""
    values = np.asarray(kjt.values()).copy()
    values[:] = rng.integers(0, 6, values.shape[0])
    return jr.KeyedJaggedTensor.from_parts(
        kjt.keys(),
        jnp.asarray(values),
        kjt.lengths(),
        kjt.weights_or_none(),
        capacities=kjt.capacity_per_key(),
        stride=kjt.stride(),
    )


def test_measured_capacities_absorb_skew():
    """Hot rows on one row-wise shard: the uniform estimate overflows (exactly), the
    measured capacity holds every batch on the fast path."""
    rng = np.random.default_rng(4)
    data = [[_skewed(k, rng) for k, _ in batches(rng)[0]] for _ in range(2)]
    kjts = [k for local in data for k in local]
    lengths = np.stack([np.asarray(k.lengths()).reshape(len(KEYS), -1) for k in kjts])
    pf = {key: float(lengths[:, i].mean()) for i, key in enumerate(KEYS)}  # measured too
    model, mesh = sharded_model("row_wise", pooling_factors=pf)
    measured = model.ebc.measure_capacities(kjts)
    uniform = model.ebc.capacities(data[0][0])
    assert measured["fp32_c8"] > uniform["fp32_c8"]  # t1's 50 rows: ids in its first 6
    forward = nnx.jit(lambda m, b: m.ebc(b).values())
    outs = []
    for capacity in (None, measured):
        m, mesh = sharded_model("row_wise", capacity=capacity, pooling_factors=pf)
        outs.append([np.asarray(forward(m, d.shard_batch(local, mesh))) for local in data])
        beyond = int(m.ebc.overflow_count.get_value().sum())
        assert (beyond > 0) == (capacity is None), beyond
    for a, b in zip(*outs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
