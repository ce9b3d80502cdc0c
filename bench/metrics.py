"""Metric update benchmark: each jaxrec metric's jitted `update` on one batch, beside
a vectorised numpy computation of the same batch result, timed in the same run.

The batch: `--samples` samples (1M by default), predictions correlated with
labels, random weights, session ids drawn Zipf-skewed (`--alpha`) from
`--samples / 50` sessions (a few huge sessions, many small), segments Zipf over
`--groups`. Every line: median / min / max ms over `--reps` calls
(after `--warmup`), `samples_per_s`, and for metrics with a numpy reference its
median and `ratio = jaxrec / numpy` (< 1: jaxrec faster); `agree` says the two
results match (rtol 1e-3, float32 against float64).

Run from the repository root::

    python bench/metrics.py --samples 1000000 --out bench/results/metrics.jsonl
    python bench/metrics.py --samples 20000 --reps 2  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import jax
import numpy as np
from common import emit, machine, time_ms

import jaxrec
from jaxrec.metrics import (
    CaliFreeNEMetric,
    GAUCMetric,
    Metric,
    NDCGMetric,
    NEMetric,
    RecallSessionMetric,
    SegmentedNEMetric,
    WindowedMetric,
)

ETA = 1e-12


# ----- numpy references (vectorised, float64) -----
def _ne_terms(p, y, w):
    q = np.clip(p, ETA, 1 - ETA)
    return -w * (y * np.log2(q) + (1 - y) * np.log2(1 - q))


def _ne(ce, num, pos, neg):
    ctr = np.clip(pos / np.maximum(num, ETA), ETA, 1 - ETA)
    return ce / (-pos * np.log2(ctr) - neg * np.log2(1 - ctr))


def np_ne(p, y, w, **_):
    return _ne(_ne_terms(p, y, w).sum(), w.sum(), (w * y).sum(), (w * (1 - y)).sum())


def np_cali_free_ne(p, y, w, **_):
    num, pos = w.sum(), (w * y).sum()
    m = (w * p).sum() / num
    return np_ne(p, y, w) / (-pos * np.log2(m) - (num - pos) * np.log2(1 - m))


def np_segmented_ne(p, y, w, *, groups, num_groups, **_):
    def per(v):
        return np.bincount(groups, v, minlength=num_groups)

    return _ne(per(_ne_terms(p, y, w)), per(w), per(w * y), per(w * (1 - y)))


def _by_session(sid, key, descending):
    order = np.lexsort((-key if descending else key, sid))
    s = sid[order]
    start = np.r_[True, s[1:] != s[:-1]]
    seg = np.cumsum(start) - 1
    first = np.maximum.accumulate(np.where(start, np.arange(len(s)), 0))
    return order, seg, first


def np_gauc(p, y, w, *, sid, **_):
    order, seg, first = _by_session(sid, p, False)
    ps, pos, neg = p[order], (w * y)[order], (w * (1 - y))[order]
    tie = np.r_[True, (seg[1:] != seg[:-1]) | (ps[1:] != ps[:-1])]
    grp = np.cumsum(tie) - 1
    gfirst = np.maximum.accumulate(np.where(tie, np.arange(len(ps)), 0))
    cum = np.cumsum(neg)
    below = (cum - neg)[gfirst] - (cum - neg)[first]
    area = pos * (below + 0.5 * np.bincount(grp, neg)[grp])
    n = seg[-1] + 1
    a, tp, tn = (np.bincount(seg, v, minlength=n) for v in (area, pos, neg))
    lo = np.full(n, np.inf)
    hi = np.full(n, -np.inf)
    np.minimum.at(lo, seg, ps)
    np.maximum.at(hi, seg, ps)
    ok = (tp > 0) & (tn > 0) & (hi > lo)
    return (a[ok] / (tp[ok] * tn[ok])).mean()


def np_ndcg(p, y, w, *, sid, k, **_):
    def dcg(key):
        order, seg, first = _by_session(sid, key, True)
        rank = np.arange(len(key)) - first + 1
        disc = np.where(rank <= k, 1 / np.log2(rank + 1), 0.0)
        return np.bincount(seg, y[order] * disc), seg, order

    obs, seg, order = dcg(p)
    ideal, _, _ = dcg(y)
    ideal[ideal == 0] = 1e-6
    wmax = np.zeros(len(obs))
    np.maximum.at(wmax, seg, w[order])
    return ((1 - obs / ideal) * wmax).mean()


def np_recall(p, y, w, *, sid, k, **_):
    order, seg, first = _by_session(sid, p, True)
    ps = p[order]
    tie = np.r_[True, (seg[1:] != seg[:-1]) | (ps[1:] != ps[:-1])]
    gfirst = np.maximum.accumulate(np.where(tie, np.arange(len(ps)), 0))
    top = (gfirst - first) < k
    ys, ws = y[order], w[order]
    return (ws * ys * top).sum() / (ws * ys).sum()


# ----- the run -----
def data(n: int, alpha: float, num_groups: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    p = rng.random(n)
    y = (rng.random(n) < 0.05 + 0.6 * p).astype(np.float64)
    w = rng.random(n) * 2
    num_sessions = max(n // 50, 1)
    sid = np.minimum(rng.zipf(alpha, n) - 1, num_sessions - 1)
    sid = rng.permutation(num_sessions)[sid].astype(np.int32)  # big sessions anywhere
    groups = np.minimum(rng.zipf(alpha, n) - 1, num_groups - 1).astype(np.int32)
    return {"p": p, "y": y, "w": w, "sid": sid, "groups": groups}


CASES: list[tuple[str, Callable[[], Metric], str | None, Callable | None, str]] = [
    # (name, metric, keyword input, numpy reference, result key)
    ("ne", lambda: NEMetric(), None, np_ne, "ne"),
    ("cali_free_ne", lambda: CaliFreeNEMetric(), None, np_cali_free_ne, "cali_free_ne"),
    ("segmented_ne", None, "grouping_keys", np_segmented_ne, "segmented_ne_0"),
    ("gauc", lambda: GAUCMetric(), "session_ids", np_gauc, "gauc"),
    ("ndcg@10", lambda: NDCGMetric(k=10), "session_ids", np_ndcg, "ndcg"),
    (
        "recall_session@5",
        lambda: RecallSessionMetric(top_threshold=5),
        "session_ids",
        np_recall,
        "recall_session_level",
    ),
    (
        "windowed_ne",
        lambda: WindowedMetric(metric=NEMetric(), window_batches=100),
        None,
        None,
        "lifetime_ne",
    ),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent of session sizes")
    ap.add_argument("--groups", type=int, default=16, help="segments of segmented NE")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    d = data(args.samples, args.alpha, args.groups, args.seed)
    f32 = {k: d[k].astype(np.float32) for k in ("p", "y", "w")}
    dev = {k: jax.device_put(v) for k, v in f32.items()}
    ids = {"session_ids": jax.device_put(d["sid"]), "grouping_keys": jax.device_put(d["groups"])}
    sizes = np.bincount(d["sid"])
    env = {
        "bench": "metrics",
        "samples": args.samples,
        "sessions": int((sizes > 0).sum()),
        "largest_session": int(sizes.max()),
        "alpha": args.alpha,
        "platform": jax.devices()[0].platform,
        **machine(),
        "jax_version": jax.__version__,
        "jaxrec_version": jaxrec.__version__,
    }
    ok = True
    for name, make, key, ref, out_key in CASES:
        metric = make() if make else SegmentedNEMetric(num_groups=args.groups)
        inputs = {key: ids[key]} if key else {}
        update = jax.jit(metric.update)
        state0 = metric.init()

        def run(update=update, state0=state0, inputs=inputs):
            return jax.block_until_ready(update(state0, dev["p"], dev["y"], dev["w"], **inputs))

        times = time_ms(run, args.reps, args.warmup)
        rec = {
            **env,
            "metric": name,
            "reps": len(times),
            "median_ms": round(statistics.median(times), 3),
            "min_ms": round(min(times), 3),
            "max_ms": round(max(times), 3),
            "samples_per_s": round(args.samples / statistics.median(times) * 1e3),
        }
        if ref is not None:
            kw = {"sid": d["sid"], "groups": d["groups"], "num_groups": args.groups}
            kw["k"] = 10 if name.startswith("ndcg") else 5
            want = np.asarray(ref(d["p"], d["y"], d["w"], **kw)).reshape(-1)[0]
            np_times = time_ms(
                lambda kw=kw, ref=ref: ref(d["p"], d["y"], d["w"], **kw), args.reps, 0
            )
            got = float(metric.compute(run())[out_key])
            agree = bool(np.isclose(got, want, rtol=1e-3))
            ok &= agree
            rec |= {
                "numpy_median_ms": round(statistics.median(np_times), 3),
                "ratio": round(statistics.median(times) / statistics.median(np_times), 3),
                "value": got,
                "numpy_value": float(want),
                "agree": agree,
            }
        emit(rec, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
