"""Exact (buffered) and streaming (histogram) AUC / AUPRC vs numpy and TorchRec."""

import jax
import numpy as np
import pytest
from metrics_refs import auc_ref, auprc_ref, binary_data, torchrec_metrics
from numpy_reference import rank_auc

from jaxrec.metrics import (
    AUCMetric,
    AUPRCMetric,
    StreamingAUCMetric,
    StreamingAUPRCMetric,
    roc_auc,
)


def _torchrec(p, y, w):
    torch, trm = torchrec_metrics()
    tr_auc, tr_auprc = trm.auc, trm.auprc
    p, y, w = (torch.tensor(np.asarray(x, np.float32)) for x in (p, y, w))
    return (
        float(tr_auc._compute_auc_helper(p, y, w)),
        float(tr_auprc._compute_auprc_helper(p, y, w)),
    )


def _run(metric, p, y, w, splits=(40, 150)):
    update = jax.jit(metric.update)
    state = metric.init()
    for part in np.split(np.arange(p.shape[-1]), list(splits)):
        state = update(state, p[..., part], y[..., part], w[..., part])
    return state


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_exact_auc_auprc_match_numpy_and_torchrec(ties, weighted):
    rng = np.random.default_rng(3)
    p, y, w = binary_data(rng, 300, weighted=weighted, ties=ties)
    auc_m, auprc_m = AUCMetric(capacity=512), AUPRCMetric(capacity=512)
    auc = float(auc_m.compute(_run(auc_m, p, y, w))["auc"])
    auprc = float(auprc_m.compute(_run(auprc_m, p, y, w))["auprc"])
    np.testing.assert_allclose(auc, auc_ref(p, y, w), rtol=1e-5)
    np.testing.assert_allclose(auprc, auprc_ref(p, y, w), rtol=1e-5)
    tr_auc_value, tr_auprc_value = _torchrec(p, y, w)
    # TorchRec's AUPRC groups ties like ours; its AUC trapezoid follows the (arbitrary)
    # order of tied samples, so it only agrees without ties.
    np.testing.assert_allclose(auprc, tr_auprc_value, rtol=1e-5)
    if not ties:
        np.testing.assert_allclose(auc, tr_auc_value, rtol=1e-5)


@pytest.mark.parametrize("case", ["all_positive", "all_negative", "zero_weights", "constant"])
def test_auc_edge_cases(case):
    rng = np.random.default_rng(4)
    p, y, w = binary_data(rng, 50)
    if case == "all_positive":
        y[:] = 1
    elif case == "all_negative":
        y[:] = 0
    elif case == "zero_weights":
        w[::2] = 0
    else:
        p[:] = 0.3
    got = []
    for m in (AUCMetric(capacity=64), AUPRCMetric(capacity=64)):
        got.append(float(next(iter(m.compute(m.update(m.init(), p, y, w)).values()))))
    want_tr = _torchrec(p, y, w)
    want_np = (auc_ref(p, y, w), auprc_ref(p, y, w))
    np.testing.assert_allclose(got, want_np, rtol=1e-5)
    if case != "constant":  # TorchRec's AUC walks the all-tied samples in sort order
        np.testing.assert_allclose(got, want_tr, rtol=1e-5)
    if case in ("all_positive", "all_negative"):
        assert got[0] == 0.5  # TorchRec's no-signal value
        assert got[1] == (1.0 if case == "all_positive" else 0.0)
    if case == "constant":
        assert got[0] == 0.5


def test_multi_task_auc_and_logits():
    rng = np.random.default_rng(5)
    p, y, w = binary_data(rng, 120, tasks=3)
    m = AUCMetric(capacity=128, num_tasks=3, from_logits=True)
    logits = np.log(p + 1e-3) - np.log1p(1e-3 - p)  # same order as p
    got = np.asarray(m.compute(_run(m, logits, y, w, splits=(50,)))["auc"])
    assert got.shape == (3,)
    np.testing.assert_allclose(got, [auc_ref(p[t], y[t], w[t]) for t in range(3)], rtol=1e-5)


def test_overflow_is_nan_and_check_raises():
    rng = np.random.default_rng(6)
    p, y, w = binary_data(rng, 100)
    m = AUCMetric(capacity=64)
    state = _run(m, p, y, w, splits=(60,))
    assert np.isnan(m.compute(state)["auc"])
    with pytest.raises(ValueError, match=r"100 samples .* capacity 64.*capacity >= 100"):
        m.check(state)
    full = m.update(m.init(), p[:64], y[:64], w[:64])  # exactly full is fine
    m.check(full)
    np.testing.assert_allclose(m.compute(full)["auc"], auc_ref(p[:64], y[:64], w[:64]), 1e-5)
    with pytest.raises(ValueError, match="on_overflow"):
        AUCMetric(capacity=8, on_overflow="drop")
    with pytest.raises(ValueError, match="capacity"):
        AUCMetric(capacity=0)


def test_window_mode_matches_torchrec_windowed_auc():
    torch, trm = torchrec_metrics()
    tr_auc, tr_auprc = trm.auc, trm.auprc
    DefaultTaskInfo = trm.metrics_config.DefaultTaskInfo
    rng = np.random.default_rng(7)
    batch, window = 32, 80
    tr_metrics = [
        cls(world_size=1, my_rank=0, batch_size=batch, tasks=[DefaultTaskInfo], window_size=window)
        for cls in (tr_auc.AUCMetric, tr_auprc.AUPRCMetric)
    ]
    ours = [
        AUCMetric(capacity=window, on_overflow="window"),
        AUPRCMetric(capacity=window, on_overflow="window"),
    ]
    states = [m.init() for m in ours]
    updates = [jax.jit(m.update) for m in ours]
    for step in range(5):
        p, y, w = binary_data(rng, batch)
        tp, ty, tw = ({"DefaultTask": torch.tensor(x)} for x in (p, y, w))
        for i, tm in enumerate(tr_metrics):
            tm.update(predictions=tp, labels=ty, weights=tw)
            states[i] = updates[i](states[i], p, y, w)
        if step < 2:
            continue  # TorchRec's AUPRC window holds a zero-weight dummy until then
        for tm, m, s in zip(tr_metrics, ours, states, strict=True):
            (name,) = m.outputs()
            reports = tm._metrics_computations[0]._compute()
            want = [r.value for r in reports if r.metric_prefix.value == "window_"][0]
            np.testing.assert_allclose(m.compute(s)[name], float(want[0]), rtol=1e-5)
            assert m.key_prefix() == "window_"


def test_merge_equals_one_stream_in_both_modes():
    rng = np.random.default_rng(8)
    p, y, w = binary_data(rng, 90)
    parts = [(p[i : i + 30], y[i : i + 30], w[i : i + 30]) for i in (0, 30, 60)]
    for mode, cap in (("error", 128), ("window", 50)):
        m = AUCMetric(capacity=cap, on_overflow=mode)
        update, merge = jax.jit(m.update), jax.jit(m.merge)
        whole = m.init()
        for part in parts:
            whole = update(whole, *part)
        a, b, c = (update(m.init(), *part) for part in parts)
        left = merge(merge(a, b), c)
        right = merge(a, merge(b, c))
        keep = slice(90 - min(cap, 90), 90)  # "window": the newest 50 samples
        want = auc_ref(p[keep], y[keep], w[keep])
        for s in (whole, left, right):
            np.testing.assert_allclose(m.compute(s)["auc"], want, rtol=1e-5, err_msg=mode)
            assert int(s.size) == min(cap, 90) and int(s.seen) == 90
    m = AUCMetric(capacity=32)  # "error": a merged overflow is flagged
    a = m.update(m.init(), *parts[0])
    assert np.isnan(m.compute(m.merge(a, a))["auc"])


def test_streaming_auc_error_is_within_its_bound_and_small():
    rng = np.random.default_rng(9)
    n = 20000
    p = rng.beta(2, 3, n).astype(np.float32)
    y = (rng.random(n) < p).astype(np.float32)
    w = rng.random(n).astype(np.float32)
    # The exact metrics (checked against numpy above) are the reference here.
    # One compile per metric: init, a single update and compute under one jit.
    one = lambda m: jax.jit(lambda *a: m.compute(m.update(m.init(), *a)))(p, y, w)
    exact_auc = float(one(AUCMetric(capacity=n))["auc"])
    exact_auprc = float(one(AUPRCMetric(capacity=n))["auprc"])
    for buckets, tol in ((100, 1e-2), (1000, 1e-3), (10000, 1e-4)):
        out = one(StreamingAUCMetric(num_buckets=buckets))
        err = abs(float(out["auc"]) - exact_auc)
        assert err <= float(out["auc_error_bound"]) + 1e-6, buckets
        assert err < tol, (buckets, err)
        if buckets == 1000:
            auprc = float(one(StreamingAUPRCMetric(num_buckets=buckets))["auprc"])
            assert abs(auprc - exact_auprc) < 2e-3
    # Predictions on the bucket grid: each distinct score has its own bucket -> exact.
    g, y, w = np.round(p[:2000] * 8) / 8, y[:2000], w[:2000]
    m = StreamingAUCMetric(num_buckets=16)
    np.testing.assert_allclose(m.compute(_run(m, g, y, w))["auc"], auc_ref(g, y, w), rtol=1e-5)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_roc_auc_matches_numpy(ties, weighted):
    rng = np.random.default_rng(5)
    p, y, w = binary_data(rng, 300, weighted=weighted, ties=ties)
    got = roc_auc(y, p, w if weighted else None)
    assert isinstance(got, float)
    want = auc_ref(*(x.astype(np.float64) for x in (p, y, w)))
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_roc_auc_is_float64_exact_on_many_samples():
    # 200k samples with ties: float32 sums of P*N pair counts would drift past 1e-9.
    rng = np.random.default_rng(6)
    n = 200_000
    scores = np.round(rng.standard_normal(n), 3)
    labels = (rng.random(n) < 1 / (1 + np.exp(-scores))).astype(np.float32)
    np.testing.assert_allclose(roc_auc(labels, scores), rank_auc(labels, scores), rtol=1e-12)


def test_roc_auc_no_signal_and_bad_input():
    assert roc_auc(np.ones(5), np.arange(5.0)) == 0.5  # no negatives: AUCMetric's 0.5
    assert roc_auc(np.zeros(5), np.arange(5.0)) == 0.5
    with pytest.raises(ValueError, match="predictions"):
        roc_auc(np.ones(3), np.array([0.1, np.nan, 0.2]))
    with pytest.raises(ValueError, match="labels"):
        roc_auc(np.array([0.0, 2.0]), np.array([0.1, 0.2]))
    with pytest.raises(ValueError, match="same number"):
        roc_auc(np.ones(3), np.arange(4.0))
