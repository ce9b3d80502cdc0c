"""float64 numpy references for the session metrics, one session at a time, written
from the definitions (no sorting tricks), and session-grouped test data."""

import numpy as np
from metrics_refs import auc_ref


def session_data(rng, n, num_sessions, *, tasks=None, graded=False):
    """Samples in random order with session ids in [0, num_sessions) (shuffled, so
    sessions are not contiguous), predictions correlated with labels."""
    shape = (n,) if tasks is None else (tasks, n)
    p = rng.random(shape)
    if graded:
        y = np.clip(np.round(p * 3 + rng.normal(0, 1, shape)), 0, 4)
    else:
        y = (rng.random(shape) < 0.1 + 0.8 * p).astype(np.float64)
    w = rng.random(shape) * 2
    sid = rng.integers(0, num_sessions, n).astype(np.int32)
    return p.astype(np.float32), y.astype(np.float32), w.astype(np.float32), sid


def _sessions(sid):
    for s in np.unique(sid):
        yield np.flatnonzero(sid == s)


def gauc_ref(p, y, w, sid, weighting="session"):
    p, y, w = (np.asarray(x, np.float64) for x in (p, y, w))
    total, count = 0.0, 0.0
    for idx in _sessions(sid):
        ps, ys, ws = p[idx], y[idx], w[idx]
        if (ws * ys).sum() <= 0 or (ws * (1 - ys)).sum() <= 0 or ps.min() == ps.max():
            continue
        weight = len(idx) if weighting == "num_samples" else 1.0
        total += weight * auc_ref(ps, ys, ws)
        count += weight
    return (total / count if count else 0.5), count


def ndcg_ref(p, y, w, sid, *, k=-1, exponential=False, decreasing=True, drop_single=False):
    p, y, w = (np.asarray(x, np.float64) for x in (p, y, w))
    total, count = 0.0, 0
    for idx in _sessions(sid):
        if drop_single and len(idx) == 1:
            continue
        gain = np.exp2(y[idx]) - 1 if exponential else y[idx]
        cut = len(idx) if k == -1 else min(k, len(idx))
        disc = 1 / np.log2(np.arange(2, cut + 2))
        by_pred = gain[np.argsort(-p[idx], kind="stable")][:cut]
        ideal = np.sort(gain)[::-1][:cut]
        idcg = (ideal * disc).sum()
        ndcg = (by_pred * disc).sum() / idcg if idcg != 0 else 0.0
        total += ((1 - ndcg) if decreasing else ndcg) * w[idx].max()
        count += 1
    return total / count


def topk_ref(p, y, w, sid, k, *, rank_labels=False):
    """(recall, precision) of "fewer than k same-session samples score higher"."""
    p, y, w = (np.asarray(x, np.float64) for x in (p, y, w))
    top, lab = np.zeros_like(p), y.copy()
    for idx in _sessions(sid):
        higher = (p[idx][None, :] > p[idx][:, None]).sum(1)
        top[idx] = higher < k
        if rank_labels:
            lab[idx] = (y[idx][None, :] > y[idx][:, None]).sum(1) < k
    tp = (w * lab * top).sum()
    return tp / (w * lab).sum(), tp / (w * top).sum()
