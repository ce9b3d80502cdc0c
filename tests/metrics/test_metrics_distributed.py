"""Reduction across devices / shards / processes, collections, and TorchRec's module keys."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from metrics_refs import binary_data, torchrec_metrics

from jaxrec.metrics import (
    AccuracyMetric,
    AUCMetric,
    AUPRCMetric,
    CalibrationMetric,
    CTRMetric,
    MAEMetric,
    MetricCollection,
    MSEMetric,
    NEMetric,
    RecMetricModule,
    StreamingAUCMetric,
    reduce_across_processes,
)


def _collection(capacity=256):
    return MetricCollection(
        {
            "ne": NEMetric(),
            "ctr": CTRMetric(),
            "calibration": CalibrationMetric(),
            "mse": MSEMetric(),
            "auc": AUCMetric(capacity=capacity),
            "auprc": AUPRCMetric(capacity=capacity, on_overflow="window"),
            "streaming_auc": StreamingAUCMetric(num_buckets=64),
        }
    )


def _assert_results_close(got, want, rtol=1e-6):
    assert set(got) == set(want)
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=1e-7, err_msg=k)


@pytest.fixture(scope="module")
def data():
    return binary_data(np.random.default_rng(10), 256)


@pytest.fixture(scope="module")
def reference(data):
    metrics = _collection()
    return metrics.compute(jax.jit(metrics.update)(metrics.init(), *data))


def test_update_on_a_batch_sharded_over_8_devices_is_global(data, reference):
    mesh = jax.make_mesh((8,), ("data",))
    sharded = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in data]
    metrics = _collection()
    state = jax.jit(metrics.update)(metrics.init(), *sharded)
    _assert_results_close(metrics.compute(state), reference)


def test_shard_map_update_then_reduce_equals_global(data, reference):
    mesh = jax.make_mesh((8,), ("data",))
    metrics = _collection()
    # Each device holds 32 samples; the exact-AUC buffers of 8 devices merge into one
    # of the same capacity (256), so it must not overflow.

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P())
    def per_device(p, y, w):
        return metrics.reduce(metrics.update(metrics.init(), p, y, w), "data")

    sharded = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in data]
    state = per_device(*sharded)
    metrics.check(state)
    _assert_results_close(metrics.compute(state), reference)


@pytest.mark.parametrize("order", ["left", "right"])
def test_merge_of_shard_states_equals_one_update(data, reference, order):
    metrics = _collection()
    update, merge = jax.jit(metrics.update), jax.jit(metrics.merge)
    parts = np.split(np.arange(256), 4)
    s = [update(metrics.init(), *(x[i] for x in data)) for i in parts]
    if order == "left":
        merged = merge(merge(merge(s[0], s[1]), s[2]), s[3])
    else:
        merged = merge(s[0], merge(s[1], merge(s[2], s[3])))
    _assert_results_close(metrics.compute(merged), reference)
    # merging an empty state changes nothing
    _assert_results_close(metrics.compute(merge(merged, metrics.init())), reference)


def test_reduce_across_processes_single_process_is_identity(data):
    metrics = _collection()
    state = jax.jit(metrics.update)(metrics.init(), *data)
    out = reduce_across_processes(metrics, state)
    chex.assert_trees_all_equal(out, state, strict=True)  # structure, dtypes, values


def test_collection_keys_and_errors():
    metrics = MetricCollection({"ne": NEMetric(), "auc_window": AUCMetric(capacity=8)})
    out = metrics.compute(metrics.init())
    assert set(out) == {"ne-ne", "ne-logloss", "auc_window-auc"}
    with pytest.raises(ValueError, match="repeat"):
        MetricCollection([AUCMetric(capacity=8), StreamingAUCMetric()])
    with pytest.raises(ValueError, match="num_tasks"):
        MetricCollection([NEMetric(), CTRMetric(num_tasks=2)])
    with pytest.raises(ValueError, match="key_format"):
        metrics.compute(metrics.init(), key_format="nested")
    with pytest.raises(TypeError, match="not a Metric"):
        MetricCollection({"x": object()})


def test_rec_metric_module_matches_torchrec_rec_metrics():
    torch, trm = torchrec_metrics()
    accuracy, auc, calibration, ctr = trm.accuracy, trm.auc, trm.calibration, trm.ctr
    mae, mse, ne = trm.mae, trm.mse, trm.ne
    RecTaskInfo = trm.metrics_config.RecTaskInfo
    compose_metric_key = trm.metrics_namespace.compose_metric_key

    batch, window, tasks = 32, 64, ["click", "like"]
    infos = [RecTaskInfo(name=t, label_name=t, prediction_name=t, weight_name=t) for t in tasks]
    kw = dict(world_size=1, my_rank=0, batch_size=batch, tasks=infos, window_size=window)
    theirs = [
        ne.NEMetric(**kw, include_logloss=True),
        ctr.CTRMetric(**kw),
        calibration.CalibrationMetric(**kw),
        accuracy.AccuracyMetric(**kw),
        mse.MSEMetric(**kw),
        mae.MAEMetric(**kw),
        auc.AUCMetric(**kw),
    ]
    ours = RecMetricModule(
        MetricCollection(
            [
                NEMetric(num_tasks=2),
                CTRMetric(num_tasks=2),
                CalibrationMetric(num_tasks=2),
                AccuracyMetric(num_tasks=2),
                MSEMetric(num_tasks=2),
                MAEMetric(num_tasks=2),
                AUCMetric(num_tasks=2, capacity=window, on_overflow="window"),
            ],
            task_names=tasks,
        ),
        key_format="torchrec",
        validate=True,
    )
    rng = np.random.default_rng(11)
    for _ in range(4):
        p, y, w = binary_data(rng, batch, tasks=2)
        ours.update(p, y, w)
        as_dict = lambda x: {t: torch.tensor(x[i]) for i, t in enumerate(tasks)}
        for m in theirs:
            m.update(predictions=as_dict(p), labels=as_dict(y), weights=as_dict(w))
    want = {}
    for m in theirs:
        # TorchRec's default (unfused) mode keeps one computation per task.
        for comp, info in zip(m._metrics_computations, infos, strict=True):
            for r in comp._compute():
                key = compose_metric_key(m._namespace, info.name, r.name, r.metric_prefix)
                want[key] = float(r.value[0])
    got = ours.compute()
    assert len(got) == 2 * 9  # 9 outputs per task
    for k, v in got.items():
        assert isinstance(v, float)
        np.testing.assert_allclose(v, want[k], rtol=2e-6, err_msg=k)
    # With MSE / MAE in the collection, only finiteness and weights >= 0 are checked.
    with pytest.raises(ValueError, match="weights must be finite and >= 0"):
        ours.update(p, y, -w)
    ours.reset()
    assert np.isnan(ours.compute()["ne-click|lifetime_ne"])


def test_rec_metric_module_raises_on_overflow():
    module = RecMetricModule([AUCMetric(capacity=16), NEMetric()], validate=True)
    p, y, w = binary_data(np.random.default_rng(12), 12)
    with pytest.raises(ValueError, match=r"predictions must be finite and in \[0, 1\]"):
        module.update(p + 1, y, w)
    module.update(p, y, w)
    assert 0 <= module.compute()["auc-auc"] <= 1
    module.update(jnp.asarray(p), y, w)
    with pytest.raises(ValueError, match="24 samples were given to a buffer of capacity 16"):
        module.compute()
