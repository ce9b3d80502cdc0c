"""float64 numpy references for jaxrec.metrics tests, written from the definitions
(independent of jaxrec's group-based formulas), and random test data."""

import warnings

import numpy as np
import pytest

ETA = 1e-12


def ne_ref(p, y, w, eta=ETA):
    p = np.clip(np.asarray(p, np.float64), eta, 1 - eta)
    ce = -(w * y * np.log2(p) + w * (1 - y) * np.log2(1 - p)).sum(-1)
    pos, neg = (w * y).sum(-1), (w * (1 - y)).sum(-1)
    ctr = np.clip(pos / np.maximum(w.sum(-1), eta), eta, 1 - eta)
    norm = -pos * np.log2(ctr) - neg * np.log2(1 - ctr)
    return {"ne": ce / norm, "logloss": ce / np.maximum(pos + neg, eta)}


def auc_ref(p, y, w):
    """Weighted Mann-Whitney statistic over all pairs (ties count 1/2)."""
    pos, neg = w * y, w * (1 - y)
    above = (p[:, None] > p[None, :]) + 0.5 * (p[:, None] == p[None, :])
    denom = pos.sum() * neg.sum()
    return 0.5 if denom == 0 else float(pos @ above @ neg / denom)


def auprc_ref(p, y, w):
    """Average precision: sum over distinct thresholds t (descending) of
    (recall(t) - recall(t_prev)) * precision(t)."""
    total_pos = (w * y).sum()
    if total_pos == 0:
        return 0.0
    out, prev_recall = 0.0, 0.0
    for t in np.unique(p)[::-1]:
        sel = p >= t
        tp, fp = (w * y)[sel].sum(), (w * (1 - y))[sel].sum()
        precision = tp / (tp + fp) if tp + fp > 0 else 1.0
        out += (tp / total_pos - prev_recall) * precision
        prev_recall = tp / total_pos
    return out


def binary_data(rng, n, *, tasks=None, weighted=True, ties=False):
    """Predictions correlated with labels; float32 arrays."""
    shape = (n,) if tasks is None else (tasks, n)
    p = rng.random(shape)
    if ties:
        p = np.round(p * 8) / 8
    y = (rng.random(shape) < 0.2 + 0.6 * p).astype(np.float32)
    w = rng.random(shape) * 2 if weighted else np.ones(shape)
    return p.astype(np.float32), y, w.astype(np.float32)


def torchrec_metrics():
    """`(torch, torchrec.metrics)` with the submodules the tests use, or skip the
    calling test. fbgemm_gpu warns (DeprecationWarning) about optional ops it lacks
    on import; that noise is not ours to fail on."""
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pytest.importorskip("torchrec")
        import torchrec.metrics.accuracy
        import torchrec.metrics.auc
        import torchrec.metrics.auprc
        import torchrec.metrics.calibration
        import torchrec.metrics.ctr
        import torchrec.metrics.mae
        import torchrec.metrics.metrics_config
        import torchrec.metrics.metrics_namespace
        import torchrec.metrics.mse
        import torchrec.metrics.ne  # noqa: F401
    return torch, torchrec.metrics
