"""Session metrics (GAUC, NDCG, session recall / precision@k) vs numpy and TorchRec."""

import functools
import importlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from metrics_refs import torchrec_metrics
from session_refs import gauc_ref, ndcg_ref, session_data, topk_ref

from jaxrec.metrics import (
    AUCMetric,
    GAUCMetric,
    MetricCollection,
    NDCGMetric,
    PrecisionSessionMetric,
    RecallSessionMetric,
    RecMetricModule,
    rank_within_session,
)


@functools.cache
def _jitted(metric):
    # One compiled update per (metric, shape) for the whole file: sorting programs
    # take seconds to compile on a loaded CPU.
    return jax.jit(metric.update)


def _run(metric, p, y, w, sid, *, batches=1):
    """jitted updates over `batches` equal parts (sessions kept whole: ids sorted)."""
    order = np.argsort(sid, kind="stable")
    parts = np.array_split(order, batches)
    update = _jitted(metric)
    state = metric.init()
    for idx in parts:
        state = update(state, p[..., idx], y[..., idx], w[..., idx], session_ids=sid[idx])
    return metric.compute(state)


def _torchrec_module(name):
    torchrec_metrics()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(f"torchrec.metrics.{name}")


def test_gauc_matches_numpy():
    rng = np.random.default_rng(0)
    p, y, w, sid = session_data(rng, 3000, 120)
    p[sid == 3] = 0.25  # one session of equal predictions: not counted
    p[:200] = np.round(p[:200] * 4) / 4  # ties within sessions count half
    for weighting in ("session", "num_samples"):
        got = _run(GAUCMetric(session_weighting=weighting), p, y, w, sid)
        want, count = gauc_ref(p, y, w, sid, weighting)
        np.testing.assert_allclose(got["gauc"], want, rtol=2e-6, err_msg=weighting)
        np.testing.assert_allclose(got["gauc_num_samples"], count, rtol=1e-6)


def test_gauc_multitask_and_merge_equal_update_on_concatenated_data():
    rng = np.random.default_rng(1)
    p, y, w, _ = session_data(rng, 1000, 1, tasks=2)
    sid = np.sort(rng.integers(0, 40, 1000)).astype(np.int32)
    sid[500:] += 40  # contiguous sessions, none split by the cut at 500
    cut = 500
    m = GAUCMetric(num_tasks=2)
    whole = m.update(m.init(), p, y, w, session_ids=sid)
    a = m.update(m.init(), p[:, :cut], y[:, :cut], w[:, :cut], session_ids=sid[:cut])
    b = m.update(m.init(), p[:, cut:], y[:, cut:], w[:, cut:], session_ids=sid[cut:])
    merged, direct = m.compute(m.merge(a, b)), m.compute(whole)
    for k in direct:
        np.testing.assert_allclose(merged[k], direct[k], rtol=1e-6, err_msg=k)
    for t in range(2):
        np.testing.assert_allclose(direct["gauc"][t], gauc_ref(p[t], y[t], w[t], sid)[0], rtol=2e-6)


def test_gauc_matches_torchrec():
    tr_gauc = _torchrec_module("gauc")
    import torch

    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 30, 150)
    lengths[-1] += 3000 - lengths.sum()  # 3000 samples: the numpy test's compiled shape
    n = int(lengths.sum())
    sid = np.repeat(np.arange(150), lengths).astype(np.int32)
    p = (0.01 + 0.98 * rng.random(n)).astype(np.float32)  # distinct, never 0 (padding)
    y = (rng.random(n) < p).astype(np.float32)
    w = rng.random(n).astype(np.float32)
    dense = np.zeros((3, 150, lengths.max()))  # TorchRec's [task, session, sample] layout
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for s, (st, ln) in enumerate(zip(starts, lengths, strict=True)):
        for i, x in enumerate((p, y, w)):
            dense[i, s, :ln] = x[st : st + ln]
    t = [torch.tensor(d[None]) for d in dense]
    ref = tr_gauc.compute_gauc_3d(*t)
    ref_gauc = tr_gauc.compute_window_auc(ref["auc_sum"], ref["num_samples"])["gauc"]
    got = _run(GAUCMetric(), p, y, w, sid)
    np.testing.assert_allclose(got["gauc"], ref_gauc.numpy()[0], rtol=2e-6)
    np.testing.assert_allclose(got["gauc_num_samples"], ref["num_samples"].numpy()[0])


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"k": 3, "exponential_gain": True},
        {"k": 1, "report_ndcg_as_decreasing_curve": False, "remove_single_length_sessions": True},
    ],
)
def test_ndcg_matches_numpy(kwargs):
    rng = np.random.default_rng(3)
    p, y, w, sid = session_data(rng, 2000, 300, graded=True)
    y[sid == 7] = 0  # a session with no relevant item: ndcg 0
    got = _run(NDCGMetric(**kwargs), p, y, w, sid, batches=2)
    # Per-batch sessions: the reference sums per part (ids sorted, split in 2).
    order = np.argsort(sid, kind="stable")
    ref_kwargs = {
        "k": kwargs.get("k", -1),
        "exponential": kwargs.get("exponential_gain", False),
        "decreasing": kwargs.get("report_ndcg_as_decreasing_curve", True),
        "drop_single": kwargs.get("remove_single_length_sessions", False),
    }
    total, count = 0.0, 0
    for idx in np.array_split(order, 2):
        part_sid = sid[idx]
        sessions = len(np.unique(part_sid))
        if ref_kwargs["drop_single"]:
            sessions -= int((np.bincount(part_sid) == 1).sum())
        total += ndcg_ref(p[idx], y[idx], w[idx], part_sid, **ref_kwargs) * sessions
        count += sessions
    np.testing.assert_allclose(got["ndcg"], total / count, rtol=2e-6)


def test_ndcg_matches_torchrec():
    k = 3
    tr_ndcg = _torchrec_module("ndcg")
    import torch

    rng = np.random.default_rng(4)
    p, y, w, sid = session_data(rng, 1500, 100, tasks=2, graded=True)
    s = tr_ndcg._get_ndcg_states(
        labels=torch.tensor(y, dtype=torch.float64),
        predictions=torch.tensor(p, dtype=torch.float64),
        weights=torch.tensor(w, dtype=torch.float64),
        session_ids=torch.tensor(np.stack([sid, sid])),
        exponential_gain=True,
        k=k,
    )
    m = NDCGMetric(num_tasks=2, k=k, exponential_gain=True)
    state = m.update(m.init(), p, y, w, session_ids=sid)
    np.testing.assert_allclose(state["sum_ndcg"].hi, s["sum_ndcg"].numpy(), rtol=2e-6)
    np.testing.assert_allclose(state["num_sessions"].hi, s["num_sessions"].numpy())


@pytest.mark.parametrize("rank_labels", [False, True])
def test_session_recall_precision_match_numpy(rank_labels):
    rng = np.random.default_rng(5)
    p, y, w, sid = session_data(rng, 2000, 100, graded=rank_labels)
    p = np.round(p * 16) / 16  # ties share the best rank
    kw = {"top_threshold": 3, "run_ranking_of_labels": rank_labels}
    recall = _run(RecallSessionMetric(**kw), p, y, w, sid)
    precision = _run(PrecisionSessionMetric(**kw), p, y, w, sid)
    want_r, want_p = topk_ref(p, y, w, sid, 3, rank_labels=rank_labels)
    np.testing.assert_allclose(recall["recall_session_level"], want_r, rtol=2e-6)
    np.testing.assert_allclose(precision["precision_session_level"], want_p, rtol=2e-6)


def test_session_recall_precision_match_torchrec():
    tr_recall = _torchrec_module("recall_session")
    tr_precision = _torchrec_module("precision_session")
    import torch

    rng = np.random.default_rng(6)
    p, y, w, sid = session_data(rng, 2000, 100)
    p = np.round(p * 16) / 16
    tp_, yt, wt = (torch.tensor(x[None], dtype=torch.float64) for x in (p, y, w))
    rank = tr_recall.ranking_within_session(tp_, torch.tensor(sid[None]))
    np.testing.assert_array_equal(rank_within_session(p, sid), rank.numpy().reshape(-1))
    top = (rank < 3).to(torch.int32)
    tp = tr_recall._calc_num_true_pos(yt, top, wt)
    recall = tp / (tp + tr_recall._calc_num_false_neg(yt, top, wt))
    precision = tp / (tp + tr_precision._calc_num_false_pos(yt, top, wt))
    got_r = _run(RecallSessionMetric(top_threshold=3), p, y, w, sid)["recall_session_level"]
    got_p = _run(PrecisionSessionMetric(top_threshold=3), p, y, w, sid)
    np.testing.assert_allclose(got_r, recall.numpy()[0], rtol=2e-6)
    np.testing.assert_allclose(got_p["precision_session_level"], precision.numpy()[0], rtol=2e-6)


def test_jit_equals_eager_and_collection_routes_session_ids():
    rng = np.random.default_rng(7)
    p, y, w, sid = session_data(rng, 500, 30)
    metrics = MetricCollection(
        [
            GAUCMetric(),
            NDCGMetric(k=4),
            RecallSessionMetric(top_threshold=2),
            AUCMetric(capacity=512),
        ]
    )
    eager = metrics.compute(metrics.update(metrics.init(), p, y, w, session_ids=sid))
    jitted = metrics.compute(jax.jit(metrics.update)(metrics.init(), p, y, w, session_ids=sid))
    for k in eager:
        np.testing.assert_allclose(jitted[k], eager[k], rtol=1e-6, err_msg=k)
    module = RecMetricModule(metrics, key_format="torchrec")
    module.update(p, y, w, session_ids=sid)
    out = module.compute()
    np.testing.assert_allclose(out["gauc-DefaultTask|lifetime_gauc"], eager["gauc-gauc"], rtol=1e-6)


def test_shard_map_reduce_equals_global_update():
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(8)
    p, y, w, _ = session_data(rng, 1024, 1)
    sid = (np.arange(1024) // 16).astype(np.int32)  # 8 sessions a device, none split
    metrics = MetricCollection(
        [GAUCMetric(), NDCGMetric(k=3), PrecisionSessionMetric(top_threshold=2)]
    )

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P())
    def per_device(p, y, w, sid):
        state = metrics.update(metrics.init(), p, y, w, session_ids=sid)
        return metrics.reduce(state, "data")

    sharded = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (p, y, w, sid)]
    got = metrics.compute(per_device(*sharded))
    want = metrics.compute(metrics.update(metrics.init(), p, y, w, session_ids=sid))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)


def test_bad_session_inputs_raise_clear_errors():
    p, y = jnp.full(8, 0.5), jnp.zeros(8)
    m = GAUCMetric()
    with pytest.raises(ValueError, match=r"takes the inputs \['session_ids'\].*missing"):
        m.update(m.init(), p, y)
    with pytest.raises(TypeError, match="session_ids must be an integer array"):
        m.update(m.init(), p, y, session_ids=jnp.zeros(8))
    with pytest.raises(ValueError, match=r"shape \[B\] = \(8,\)"):
        m.update(m.init(), p, y, session_ids=jnp.zeros(7, jnp.int32))
    with pytest.raises(ValueError, match="unexpected"):
        m.update(m.init(), p, y, session_ids=jnp.zeros(8, jnp.int32), user=jnp.zeros(8, jnp.int32))
    with pytest.raises(ValueError, match="no metric takes the inputs"):
        c = MetricCollection([AUCMetric(capacity=8)])
        c.update(c.init(), p, y, session_ids=jnp.zeros(8, jnp.int32))
    with pytest.raises(ValueError, match="session_weighting"):
        GAUCMetric(session_weighting="users")
    with pytest.raises(ValueError, match="top_threshold"):
        RecallSessionMetric(top_threshold=0)
    with pytest.raises(ValueError, match="k must be -1"):
        NDCGMetric(k=0)
    # A renamed key routes by that name.
    m = NDCGMetric(session_key="query_ids")
    m.update(m.init(), p, y, query_ids=jnp.zeros(8, jnp.int32))
