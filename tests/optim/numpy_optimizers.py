"""FBGEMM's sparse optimizers re-written in float64 numpy, one row at a time.

An oracle for ``jaxrec.optim``, written from FBGEMM's published kernels
(``fbgemm_gpu/codegen/genscript/optimizers.py``: ``split_precomputation`` and
``split_weight_update``), not from jaxrec. Each ``<name>_row`` updates one row
``w [D]`` with its summed gradient ``g [D]`` and its state slices (``[D]`` arrays
or row-wise floats), at step ``t`` (FBGEMM's ``iter``, 1 on the first step) and
learning rate ``lr``. Where FBGEMM divides by a zero norm (NaN) the guard jaxrec
documents is used; everything else is FBGEMM's arithmetic as written.

SGD and Adagrad take no weight decay in FBGEMM; their L2/DECOUPLE branches here
are the ``torch.optim`` formulas jaxrec documents as its extension.
"""

from __future__ import annotations

import math

import numpy as np


def sgd_row(w, g, st, t, lr, weight_decay=0.0, weight_decay_mode="NONE"):
    # FBGEMM: weight_new.fma_(grad, -learning_rate)
    w, g = w.copy(), g.copy()
    if weight_decay_mode == "L2":
        g = g + weight_decay * w
    if weight_decay_mode == "DECOUPLE":
        w = w - lr * weight_decay * w
    return w - lr * g, st


def adagrad_row(w, g, st, t, lr, eps=1e-8, weight_decay=0.0, weight_decay_mode="NONE"):
    w, g = w.copy(), g.copy()
    if weight_decay_mode == "L2":
        g = g + weight_decay * w
    new_w = w - lr * weight_decay * w if weight_decay_mode == "DECOUPLE" else w.copy()
    m = st["momentum1"].copy()
    for d in range(w.shape[0]):
        # m_t += grad * grad; weight_new -= learning_rate * grad / (sqrtf(m_t) + eps)
        m[d] += g[d] * g[d]
        new_w[d] -= lr * g[d] / (math.sqrt(m[d]) + eps)
    return new_w, {"momentum1": m}


def rowwise_adagrad_row(w, g, st, t, lr, eps=1e-8, weight_decay=0.0, weight_decay_mode="NONE"):
    D = w.shape[0]
    sum_sq = 0.0
    for d in range(D):
        gd = g[d]
        if weight_decay_mode == "L2":  # weight_decay_mode == 1
            gd += weight_decay * w[d]
        sum_sq += gd * gd
    new_sum_square_grads = st["momentum1"] + sum_sq / D
    multiplier = lr / (math.sqrt(new_sum_square_grads) + eps)
    if weight_decay_mode == "L2":
        correction = 1.0 - multiplier * weight_decay
    elif weight_decay_mode == "DECOUPLE":  # weight_decay_mode == 2
        correction = 1.0 - lr * weight_decay
    else:
        correction = 1.0
    # weight_new = correction * weight_new - multiplier * grad (the raw gradient)
    new_w = np.array([correction * w[d] - multiplier * g[d] for d in range(D)])
    return new_w, {"momentum1": new_sum_square_grads}


def adam_row(w, g, st, t, lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0):
    m = b1 * st["momentum1"] + (1.0 - b1) * g
    v = b2 * st["momentum2"] + (1.0 - b2) * g * g
    new_w = w.copy()
    for d in range(w.shape[0]):
        # weight_new -= lr * (m/(1-b1^iter) / (sqrt(v/(1-b2^iter)) + eps) + wd * weight_new)
        new_w[d] -= lr * (
            m[d] / (1.0 - b1**t) / (math.sqrt(v[d] / (1.0 - b2**t)) + eps) + weight_decay * w[d]
        )
    return new_w, {"momentum1": m, "momentum2": v}


def partial_rowwise_adam_row(w, g, st, t, lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0):
    g_avg_square = float(np.sum(g * g)) / w.shape[0]
    v_t = g_avg_square * (1.0 - b2) + st["momentum2"] * b2
    v_hat_t = v_t / (1.0 - b2**t)
    m = b1 * st["momentum1"] + (1.0 - b1) * g
    new_w = w.copy()
    for d in range(w.shape[0]):
        new_w[d] -= lr * (m[d] / (1.0 - b1**t) / (math.sqrt(v_hat_t) + eps) + weight_decay * w[d])
    return new_w, {"momentum1": m, "momentum2": v_t}


def _trust_ratio(weight_norm, rtw_norm):
    # FBGEMM: true_ratio = weight_norm / rtw_norm (NaN at rtw_norm == 0: guarded, no update).
    return weight_norm / rtw_norm if rtw_norm > 0 else 0.0


def lamb_row(w, g, st, t, lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0):
    m1 = b1 * st["momentum1"] + (1.0 - b1) * g
    m2 = b2 * st["momentum2"] + (1.0 - b2) * g * g
    rtw = np.array(
        [
            (m1[d] / (1.0 - b1**t)) / (math.sqrt(m2[d] / (1.0 - b2**t)) + eps) + weight_decay * w[d]
            for d in range(w.shape[0])
        ]
    )
    ratio = _trust_ratio(math.sqrt(np.sum(w * w)), math.sqrt(np.sum(rtw * rtw)))
    return w - lr * ratio * rtw, {"momentum1": m1, "momentum2": m2}


def partial_rowwise_lamb_row(w, g, st, t, lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0):
    g_avg_square = float(np.sum(g * g)) / w.shape[0]
    m2 = b2 * st["momentum2"] + (1.0 - b2) * g_avg_square
    m2_hat = 1.0 / (math.sqrt(m2 / (1.0 - b2**t)) + eps)
    m1 = b1 * st["momentum1"] + (1.0 - b1) * g
    rtw = (m1 / (1.0 - b1**t)) * m2_hat + weight_decay * w
    ratio = _trust_ratio(math.sqrt(np.sum(w * w)), math.sqrt(np.sum(rtw * rtw)))
    return w - lr * ratio * rtw, {"momentum1": m1, "momentum2": m2}


def lars_sgd_row(w, g, st, t, lr, eta=0.001, momentum=0.9, weight_decay=0.0):
    weight_norm = math.sqrt(np.sum(w * w))
    grad_norm = math.sqrt(np.sum(g * g))
    denom = grad_norm + weight_decay * weight_norm
    # FBGEMM: adjusted_lr = lr * eta * weight_norm / denom (NaN at denom == 0: guarded to 0).
    adjusted_lr = lr * eta * weight_norm / denom if denom > 0 else 0.0
    m1 = momentum * st["momentum1"] + adjusted_lr * (g + weight_decay * w)
    return w - m1, {"momentum1": m1}


ROW_UPDATES = {
    "sgd": sgd_row,
    "adagrad": adagrad_row,
    "rowwise_adagrad": rowwise_adagrad_row,
    "adam": adam_row,
    "partial_rowwise_adam": partial_rowwise_adam_row,
    "lamb": lamb_row,
    "partial_rowwise_lamb": partial_rowwise_lamb_row,
    "lars_sgd": lars_sgd_row,
}

# State fields and whether each is row-wise ([rows]) or element-wise ([rows, dim]),
# as FBGEMM sizes them (``construct_split_state(rowwise=...)``).
STATE_LAYOUT = {
    "sgd": {},
    "adagrad": {"momentum1": False},
    "rowwise_adagrad": {"momentum1": True},
    "adam": {"momentum1": False, "momentum2": False},
    "partial_rowwise_adam": {"momentum1": False, "momentum2": True},
    "lamb": {"momentum1": False, "momentum2": False},
    "partial_rowwise_lamb": {"momentum1": False, "momentum2": True},
    "lars_sgd": {"momentum1": False},
}


def init_state(name: str, num_rows: int, dim: int) -> dict[str, np.ndarray]:
    """Zero state, float64: ``{field: [rows] or [rows, dim]}``."""
    return {
        f: np.zeros((num_rows,) if rowwise else (num_rows, dim))
        for f, rowwise in STATE_LAYOUT[name].items()
    }


def apply_rows(name, table, state, rows, grads, t, lr, **hyperparams):
    """One step on the touched ``rows`` (ids ``>= num_rows`` skipped), float64 copies.

    Args:
        name: a key of ``ROW_UPDATES``.
        table: ``[R, D]`` weights.
        state: ``init_state``-shaped dict.
        rows: ``[U]`` unique row ids.
        grads: ``[U, D]`` summed gradients.
        t: the step number (1 on the first step).
        lr: this step's learning rate.
        **hyperparams: the optimizer's keyword hyper-parameters.

    Returns:
        ``(table, state)`` after the step.
    """
    table = np.array(table, np.float64)
    state = {f: np.array(a, np.float64) for f, a in state.items()}
    grads = np.asarray(grads, np.float64)
    update = ROW_UPDATES[name]
    for i, r in enumerate(np.asarray(rows)):
        if r >= table.shape[0]:
            continue
        st = {f: a[r].copy() if a.ndim == 2 else float(a[r]) for f, a in state.items()}
        new_w, new_st = update(table[r].copy(), grads[i].copy(), st, t, lr, **hyperparams)
        table[r] = new_w
        for f, a in new_st.items():
            state[f][r] = a
    return table, state
