"""NE / logloss, CTR, calibration, accuracy, MSE / MAE vs numpy and TorchRec's own maths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from metrics_refs import ETA, binary_data, ne_ref, torchrec_metrics

from jaxrec.metrics import (
    AccuracyMetric,
    CalibrationMetric,
    CTRMetric,
    MAEMetric,
    MetricCollection,
    MSEMetric,
    NEMetric,
    validate_inputs,
)


def _collection(num_tasks=None):
    return MetricCollection(
        [
            NEMetric(num_tasks=num_tasks),
            CTRMetric(num_tasks=num_tasks),
            CalibrationMetric(num_tasks=num_tasks),
            AccuracyMetric(num_tasks=num_tasks, threshold=0.4),
            MSEMetric(num_tasks=num_tasks, include_r_squared=True),
            MAEMetric(num_tasks=num_tasks),
        ]
    )


def _torchrec_results(p, y, w):
    """TorchRec 1.8's state and compute functions on float64 tensors."""
    torch, trm = torchrec_metrics()
    tr_ne, tr_ctr, tr_cal, tr_acc = trm.ne, trm.ctr, trm.calibration, trm.accuracy
    tr_mse, tr_mae = trm.mse, trm.mae
    p, y, w = (torch.tensor(np.asarray(x, np.float64)) for x in (p, y, w))
    s = tr_ne.get_ne_states(y, p, w, ETA)
    out = {
        "ne-ne": tr_ne.compute_ne(
            s["cross_entropy_sum"],
            s["weighted_num_samples"],
            s["pos_labels"],
            s["neg_labels"],
            ETA,
        ),
        "ne-logloss": tr_ne.compute_logloss(
            s["cross_entropy_sum"], s["pos_labels"], s["neg_labels"], ETA
        ),
    }
    s = tr_ctr.get_ctr_states(y, p, w)
    out["ctr-ctr"] = tr_ctr.compute_ctr(s["ctr_num"], s["ctr_denom"])
    s = tr_cal.get_calibration_states(y, p, w)
    out["calibration-calibration"] = tr_cal.compute_calibration(
        s["calibration_num"], s["calibration_denom"]
    )
    s = tr_acc.get_accuracy_states(y, p, w, 0.4)
    out["accuracy-accuracy"] = tr_acc.compute_accuracy(s["accuracy_sum"], s["weighted_num_samples"])
    s = tr_mse.get_mse_states(y, p, w)
    out["mse-mse"] = tr_mse.compute_mse(s["error_sum"], s["weighted_num_samples"])
    out["mse-rmse"] = tr_mse.compute_rmse(s["error_sum"], s["weighted_num_samples"])
    out["mse-r_squared"] = tr_mse.compute_r_squared(
        s["error_sum"], s["weighted_num_samples"], s["label_sum"], s["label_squared_sum"]
    )
    s = tr_mae.get_mae_states(y, p, w)
    out["mae-mae"] = tr_mae.compute_mae(s["error_sum"], s["weighted_num_samples"])
    return {k: v.numpy() for k, v in out.items()}


def _numpy_results(p, y, w):
    p, y, w = (np.asarray(x, np.float64) for x in (p, y, w))
    num = w.sum(-1)
    err2 = (w * (y - p) ** 2).sum(-1)
    total = (w * y * y).sum(-1) - (w * y).sum(-1) ** 2 / num
    ne = ne_ref(p, y, w)
    return {
        "ne-ne": ne["ne"],
        "ne-logloss": ne["logloss"],
        "ctr-ctr": (w * y).sum(-1) / num,
        "calibration-calibration": (w * p).sum(-1) / (w * y).sum(-1),
        "accuracy-accuracy": (w * ((p >= 0.4) == y)).sum(-1) / num,
        "mse-mse": err2 / num,
        "mse-rmse": np.sqrt(err2 / num),
        "mse-r_squared": 1 - err2 / total,
        "mae-mae": (w * np.abs(y - p)).sum(-1) / num,
    }


@pytest.mark.parametrize("num_tasks", [None, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_sum_metrics_match_numpy_and_torchrec(num_tasks, weighted):
    rng = np.random.default_rng(0)
    p, y, w = binary_data(rng, 600, tasks=num_tasks, weighted=weighted)
    metrics = _collection(num_tasks)
    update = jax.jit(metrics.update)
    state = metrics.init()
    for part in np.split(np.arange(600), [100, 350]):  # three uneven batches
        state = update(state, p[..., part], y[..., part], w[..., part] if weighted else None)
    got = metrics.compute(state)
    ref_np, ref_tr = _numpy_results(p, y, w), _torchrec_results(p, y, w)
    assert set(got) == set(ref_np) == set(ref_tr)
    for k in got:
        shape = () if num_tasks is None else (num_tasks,)
        assert got[k].shape == shape, k
        np.testing.assert_allclose(got[k], ref_np[k], rtol=2e-6, err_msg=k)
        np.testing.assert_allclose(got[k], ref_tr[k], rtol=2e-6, err_msg=k)


@pytest.mark.parametrize(
    "case", ["all_positive", "all_negative", "some_zero_weights", "all_zero_weights", "extreme"]
)
def test_edge_cases_match_torchrec(case):
    rng = np.random.default_rng(1)
    p, y, w = binary_data(rng, 64)
    if case == "all_positive":
        y[:] = 1
    elif case == "all_negative":
        y[:] = 0
    elif case == "some_zero_weights":
        w[::3] = 0
    elif case == "all_zero_weights":
        w[:] = 0
    elif case == "extreme":  # predictions at 0 and 1 exactly, clamped by eta
        p[:20], p[20:40] = 0.0, 1.0
    metrics = _collection()
    got = metrics.compute(metrics.update(metrics.init(), p, y, w))
    ref = _torchrec_results(p, y, w)
    for k in got:
        # With one label class NE is ~1e12 (a ~0 base entropy clamped by eta); TorchRec's
        # float64 `1 - eta` is itself off by 1e-4 relative, so compare loosely there.
        rtol = 1e-4 if case in ("all_positive", "all_negative") and k == "ne-ne" else 1e-5
        np.testing.assert_allclose(got[k], ref[k], rtol=rtol, equal_nan=True, err_msg=k)
    if case == "some_zero_weights":  # zero-weight samples change nothing
        keep = w > 0
        alone = metrics.compute(metrics.update(metrics.init(), p[keep], y[keep], w[keep]))
        for k in got:
            np.testing.assert_allclose(got[k], alone[k], rtol=1e-6, err_msg=k)


def test_ne_from_logits_is_exact_in_the_tails():
    rng = np.random.default_rng(2)
    x = rng.normal(0, 3, 256).astype(np.float32)
    x[:8] = [40, -40, 30, -30, 18, -18, 90, -90]  # sigmoid saturates in float32 here
    y = (rng.random(256) < 0.5).astype(np.float32)
    m = NEMetric(from_logits=True)
    got = m.compute(m.update(m.init(), x, y))
    # float64 reference on log-probabilities with TorchRec's eta clamp
    xd = x.astype(np.float64)
    log_p = np.maximum(-np.logaddexp(0, -xd), np.log(ETA))
    log_q = np.maximum(-np.logaddexp(0, xd), np.log(ETA))
    ce = -(y * log_p + (1 - y) * log_q).sum() / np.log(2)
    np.testing.assert_allclose(got["logloss"], ce / 256, rtol=1e-6)
    ctr = y.mean()
    norm = -(y.sum() * np.log2(ctr) + (256 - y.sum()) * np.log2(1 - ctr))
    np.testing.assert_allclose(got["ne"], ce / norm, rtol=1e-6)
    # Moderate logits agree with the probability path.
    mp = NEMetric()
    probs = jax.nn.sigmoid(x[8:])
    via_probs = mp.compute(mp.update(mp.init(), probs, y[8:]))
    via_logits = m.compute(m.update(m.init(), x[8:], y[8:]))
    np.testing.assert_allclose(via_logits["ne"], via_probs["ne"], rtol=1e-5)


def test_compensated_sums_keep_float32_accumulators_exact():
    m = CTRMetric()
    state = m.init()
    big = jnp.float32(2.0**24)  # float32 spacing is 2 here: `big + 1 == big`
    state = {k: s._replace(hi=s.hi + big) for k, s in state.items()}
    update = jax.jit(m.update)
    ones = jnp.ones(4, jnp.float32) / 4
    for _ in range(50):
        state = update(state, ones, ones, ones)  # weights sum to 1 per batch
    assert float(jnp.float32(2.0**24) + 1) == 2.0**24  # what a plain float32 sum would do
    total = float(np.float64(state["ctr_denom"].hi) + np.float64(state["ctr_denom"].lo))
    assert total == 2.0**24 + 50


def test_bad_shapes_and_dtypes_raise_clear_errors():
    m = NEMetric()
    s = m.init()
    p = jnp.full(8, 0.5)
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        m.update(s, jnp.full((2, 8), 0.5), jnp.zeros((2, 8)))
    with pytest.raises(ValueError, match="labels must have the shape"):
        m.update(s, p, jnp.zeros(7))
    with pytest.raises(ValueError, match="weights must have the shape"):
        m.update(s, p, jnp.zeros(8), jnp.ones(3))
    with pytest.raises(TypeError, match="floating point"):
        m.update(s, jnp.zeros(8, jnp.int32), jnp.zeros(8))
    m2 = NEMetric(num_tasks=2)
    with pytest.raises(ValueError, match=r"\[2, B\]"):
        m2.update(m2.init(), jnp.full((3, 8), 0.5), jnp.zeros((3, 8)))
    # [B] weights broadcast over tasks
    s2 = m2.update(m2.init(), jnp.full((2, 8), 0.5), jnp.ones((2, 8)), jnp.ones(8))
    np.testing.assert_allclose(s2["weighted_num_samples"].hi, [8, 8])
    with pytest.raises(ValueError, match="num_tasks"):
        NEMetric(num_tasks=0)


def test_validate_inputs_names_the_bad_entry():
    validate_inputs(np.array([0.0, 1.0]), np.array([1, 0]), np.array([0.0, 2.0]))
    with pytest.raises(ValueError, match=r"predictions must be finite and in \[0, 1\].*\(1,\)"):
        validate_inputs(np.array([0.5, 1.5]), np.array([1, 0]))
    with pytest.raises(ValueError, match="predictions must be finite;"):
        validate_inputs(np.array([0.5, np.nan]), np.array([1, 0]), probabilities=False)
    with pytest.raises(ValueError, match="weights must be finite and >= 0"):
        validate_inputs(np.array([0.5, 0.5]), np.array([1, 0]), np.array([1.0, -1.0]))
    with pytest.raises(ValueError, match=r"labels must be finite and in \[0, 1\]"):
        validate_inputs(np.array([0.5, 0.5]), np.array([1, 2]))
    validate_inputs(np.array([3.0]), np.array([7.0]), probabilities=False, binary_labels=False)
