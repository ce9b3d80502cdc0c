"""Segmented and calibration-free NE, lifetime/window views, throughput: vs numpy and
TorchRec."""

import importlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from metrics_refs import ETA, binary_data, ne_ref, torchrec_metrics

from jaxrec.metrics import (
    AUCMetric,
    CaliFreeNEMetric,
    CTRMetric,
    GAUCMetric,
    MetricCollection,
    NEMetric,
    SegmentedNEMetric,
    ThroughputMetric,
    WindowedMetric,
)


def _torchrec_module(name):
    torchrec_metrics()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(f"torchrec.metrics.{name}")


def test_segmented_ne_on_1m_samples_matches_numpy():
    rng = np.random.default_rng(0)
    n, groups = 1_000_000, 7
    p, y, w = binary_data(rng, n)
    g = np.minimum(rng.zipf(1.5, n) - 1, groups - 1).astype(np.int32)  # skewed segments
    m = SegmentedNEMetric(num_groups=groups, include_logloss=True)
    update = jax.jit(m.update)
    state = m.init()
    for part in np.array_split(np.arange(n), 2):
        state = update(state, p[part], y[part], w[part], grouping_keys=g[part])
    got = m.compute(state)
    for k in range(groups):
        ref = ne_ref(p[g == k], y[g == k], w[g == k])
        np.testing.assert_allclose(got[f"segmented_ne_{k}"], ref["ne"], rtol=2e-5)
        np.testing.assert_allclose(got[f"logloss_{k}"], ref["logloss"], rtol=2e-5)


def test_segmented_and_cali_free_ne_match_torchrec():
    tr_seg = _torchrec_module("segmented_ne")
    tr_cf = _torchrec_module("cali_free_ne")
    import torch

    rng = np.random.default_rng(1)
    p, y, w = binary_data(rng, 3000, tasks=2)
    g = rng.integers(0, 5, 3000).astype(np.int32)
    t = [torch.tensor(x, dtype=torch.float64) for x in (y, p, w)]
    s = tr_seg.get_segemented_ne_states_fused(*t, torch.tensor(g), eta=ETA, num_groups=5, n_tasks=2)
    ref_ne = tr_seg.compute_ne_fused(
        s["cross_entropy_sum"],
        s["weighted_num_samples"],
        s["pos_labels"],
        s["neg_labels"],
        num_groups=5,
        n_tasks=2,
        eta=ETA,
    )
    m = SegmentedNEMetric(num_tasks=2, num_groups=5)
    got = m.compute(m.update(m.init(), p, y, w, grouping_keys=g))
    for k in range(5):
        np.testing.assert_allclose(got[f"segmented_ne_{k}"], ref_ne[:, k].numpy(), rtol=2e-6)

    s = tr_cf.get_cali_free_ne_states(*t, ETA)
    ref = tr_cf.compute_cali_free_ne(*s.values(), ETA)
    m = CaliFreeNEMetric(num_tasks=2)
    got = m.compute(m.update(m.init(), p, y, w))
    np.testing.assert_allclose(got["cali_free_ne"], ref.numpy(), rtol=2e-6)


def test_cali_free_ne_matches_numpy_and_merges():
    rng = np.random.default_rng(2)
    p, y, w = binary_data(rng, 4000)
    m = CaliFreeNEMetric()
    a = m.update(m.init(), p[:1500], y[:1500], w[:1500])
    b = m.update(m.init(), p[1500:], y[1500:], w[1500:])
    got = m.compute(m.merge(a, b))["cali_free_ne"]
    pd, yd, wd = (x.astype(np.float64) for x in (p, y, w))
    total, pos, mean_pred = wd.sum(), (wd * yd).sum(), (wd * pd).sum() / wd.sum()
    denom = -pos * np.log2(mean_pred) - (total - pos) * np.log2(1 - mean_pred)
    np.testing.assert_allclose(got, ne_ref(pd, yd, wd)["ne"] / denom, rtol=2e-6)


def test_window_keeps_the_last_batches_and_lifetime_all():
    rng = np.random.default_rng(3)
    batches = [binary_data(rng, 256) for _ in range(7)]
    sids = [rng.integers(0, 16, 256).astype(np.int32) for _ in range(7)]
    metrics = MetricCollection(
        {
            "ne": WindowedMetric(metric=NEMetric(), window_batches=3),
            "gauc": WindowedMetric(metric=GAUCMetric(), window_batches=3),
        }
    )
    update = jax.jit(metrics.update)
    state = metrics.init()
    for (p, y, w), sid in zip(batches, sids, strict=True):
        state = update(state, p, y, w, session_ids=sid)
    got = metrics.compute(state, key_format="torchrec")
    cat = [np.concatenate(x) for x in zip(*batches, strict=True)]
    last = [np.concatenate(x) for x in zip(*batches[-3:], strict=True)]
    ne = NEMetric()
    lifetime = ne.compute(ne.update(ne.init(), *cat))
    window = ne.compute(ne.update(ne.init(), *last))
    np.testing.assert_allclose(got["ne-DefaultTask|lifetime_ne"], lifetime["ne"], rtol=1e-6)
    np.testing.assert_allclose(got["ne-DefaultTask|window_ne"], window["ne"], rtol=1e-6)
    np.testing.assert_allclose(got["ne-DefaultTask|window_logloss"], window["logloss"], rtol=1e-6)
    # GAUC's window averages the sessions of the last 3 batches (sessions are per batch).
    gm = GAUCMetric()
    per_batch = [
        gm.batch_sums(*map(jnp.asarray, b), session_ids=s)
        for b, s in zip(batches, sids, strict=True)
    ]
    want = sum(float(b["auc_sum"]) for b in per_batch[-3:]) / sum(
        float(b["num_samples"]) for b in per_batch[-3:]
    )
    np.testing.assert_allclose(got["gauc-DefaultTask|window_gauc"], want, rtol=1e-6)


def test_window_merge_of_shards_equals_update_on_concatenated_batches():
    rng = np.random.default_rng(4)
    m = WindowedMetric(metric=CTRMetric(num_tasks=2), window_batches=2)
    whole, left, right = m.init(), m.init(), m.init()
    for _ in range(3):  # two shards of each batch, in lockstep
        p, y, w = binary_data(rng, 64, tasks=2)
        whole = m.update(whole, p, y, w)
        left = m.update(left, p[:, :20], y[:, :20], w[:, :20])
        right = m.update(right, p[:, 20:], y[:, 20:], w[:, 20:])
    got, want = m.compute(m.merge(left, right)), m.compute(whole)
    assert set(got) == {"lifetime_ctr", "window_ctr"}
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)
    eager = m.compute(m.update(whole, p, y, w))
    jitted = m.compute(jax.jit(m.update)(whole, p, y, w))
    for k in eager:
        np.testing.assert_allclose(jitted[k], eager[k], rtol=1e-6, err_msg=k)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="SumMetric.*on_overflow='window'"):
        WindowedMetric(metric=AUCMetric(capacity=8), window_batches=2)
    with pytest.raises(ValueError, match="window_batches"):
        WindowedMetric(metric=NEMetric(), window_batches=0)
    with pytest.raises(ValueError, match="num_groups"):
        SegmentedNEMetric(num_groups=0)
    m = SegmentedNEMetric(num_groups=3)
    p, y = jnp.full(4, 0.5), jnp.array([0.0, 1, 0, 1])
    state = m.update(m.init(), p, y, grouping_keys=jnp.array([0, 1, 3, -1], jnp.int32))
    assert np.isnan(m.compute(state)["segmented_ne_0"])  # never a wrong number
    with pytest.raises(
        ValueError, match=r"2 samples had grouping_keys outside \[0, num_groups=3\)"
    ):
        m.check(state)
    with pytest.raises(ValueError, match="missing"):
        m.update(m.init(), p, y)
    with pytest.raises(ValueError, match="warmup_steps"):
        ThroughputMetric(batch_size=8, world_size=1, window_seconds=10, warmup_steps=0)


def test_throughput_matches_torchrec_on_a_fake_clock(monkeypatch):
    tr_tp = _torchrec_module("throughput")
    times = np.cumsum(np.random.default_rng(5).uniform(0.05, 0.4, 60)).tolist()
    ours = ThroughputMetric(
        batch_size=512, world_size=4, window_seconds=3, warmup_steps=5, clock=iter(times).__next__
    )
    clock = iter(times)
    monkeypatch.setattr(tr_tp.time, "monotonic", lambda: next(clock))
    theirs = tr_tp.ThroughputMetric(batch_size=512, world_size=4, window_seconds=3, warmup_steps=5)
    assert "throughput-throughput|lifetime_throughput" not in ours.compute()
    for _ in times:
        ours.update()
        theirs.update()
    got, want = ours.compute(), theirs.compute()
    for key in (
        "throughput-throughput|total_examples",
        "throughput-throughput|lifetime_throughput",
        "throughput-throughput|window_throughput",
    ):
        np.testing.assert_allclose(got[key], float(want[key]), rtol=1e-9, err_msg=key)
    # Independent check: 55 timed steps of 2048 examples.
    np.testing.assert_allclose(
        got["throughput-throughput|lifetime_throughput"], 55 * 2048 / (times[-1] - times[4])
    )
