"""FBGEMM's fused optimizers in numpy with FBGEMM's float32 / float64 rounding.

``numpy_optimizers`` checks the maths in float64; this module checks the
rounding. Each ``<name>_row`` mirrors one expression of FBGEMM's generated
CUDA kernel (``fbgemm_gpu/codegen/genscript/optimizers.py``, the function of
the same name: ``split_precomputation`` + ``split_weight_update``) with C++'s
types made explicit:

* every tensor element, hyper-parameter (``learning_rate``, ``eps``,
  ``beta1``, ...) and ``iter`` is a C ``float`` (``f32``); float op float is
  rounded to float32 after each operation;
* the literal ``1.0`` is a ``double``: ``1.0 - beta1`` and everything computed
  from it stays float64 (``f64``) until it is stored into a float variable,
  passed to a float parameter (``sqrtf``, ``Vec4T::fma_``) or written back;
* ``Vec4T::fma_(a, b)`` is ``fmaf(a, b, acc)``, one rounding;
* ``powf(beta, iter)`` is taken as correctly rounded (float64 pow, rounded).

Not modelled, each at most an ulp of the value it touches: nvcc's default
``--fmad=true`` contraction of other ``x + y * z`` expressions, the order of the
warp-shuffle row sums (here: exact sums rounded once), and double rounding
(``fmaf`` and double-to-float stores are computed in float64 and rounded).

SGD and Adagrad take no weight decay in FBGEMM; their L2 / DECOUPLE branches
are jaxrec's extension, written in float32 as jaxrec documents them.
"""

from __future__ import annotations

import numpy as np

f32, f64 = np.float32, np.float64


def fmaf(a, b, c):
    """``fmaf(a, b, c)``: the float32 product is exact in float64, then one rounding."""
    return f32(f64(a) * f64(b) + f64(c))


def powf(base, exponent):
    """``powf`` for a float base and a small integral float exponent, correctly rounded."""
    return f32(f64(base) ** f64(exponent))


def row_sum(x):
    """A float reduction over the row (``GROUP_REDUCE_ALL_SUM``), rounded once."""
    return f32(np.sum(np.asarray(x, f64)))


def _decayed(w, g, lr, weight_decay, mode):
    """jaxrec's SGD/Adagrad weight-decay extension: ``(w, g)`` before the step."""
    wd = f32(weight_decay)
    if mode == "L2":
        g = f32(g + f32(wd * w))
    if mode == "DECOUPLE":
        w = f32(w - f32(f32(lr * wd) * w))
    return w, g


def sgd_row(w, g, st, t, lr, weight_decay=0.0, weight_decay_mode="NONE"):
    w, g = _decayed(w, g, lr, weight_decay, weight_decay_mode)
    return fmaf(g, -lr, w), st  # sgd: weight_new.fma_(grad, -learning_rate)


def adagrad_row(w, g, st, t, lr, eps=1e-8, weight_decay=0.0, weight_decay_mode="NONE"):
    w, g = _decayed(w, g, lr, weight_decay, weight_decay_mode)
    # adagrad: m_t += grad * grad; weight_new -= learning_rate * grad / (sqrtf(m_t) + eps)
    m = f32(st["momentum1"] + f32(g * g))
    w = f32(w - f32(f32(lr * g) / f32(np.sqrt(m) + f32(eps))))
    return w, {"momentum1": m}


def rowwise_adagrad_row(w, g, st, t, lr, eps=1e-8, weight_decay=0.0, weight_decay_mode="NONE"):
    wd, mode = f32(weight_decay), weight_decay_mode
    gx = f32(g + f32(wd * w)) if mode == "L2" else g  # weight_decay_mode == 1
    g_avg_square = f32(row_sum(f32(gx * gx)) / f32(w.shape[0]))
    new_sum_square_grads = f32(st["momentum1"] + g_avg_square)
    multiplier = f32(lr / f32(np.sqrt(new_sum_square_grads) + f32(eps)))
    if mode == "L2":  # correction = 1.0 - multiplier * weight_decay (double 1.0)
        correction = f32(1.0 - f64(f32(multiplier * wd)))
    elif mode == "DECOUPLE":  # weight_decay_mode == 2: 1.0 - learning_rate * weight_decay
        correction = f32(1.0 - f64(f32(lr * wd)))
    else:
        correction = f32(1.0)
    # weight_new = correction * weight_new - multiplier * grad (the raw gradient)
    w = f32(f32(correction * w) - f32(multiplier * g))
    return w, {"momentum1": new_sum_square_grads}


def _bias_corrections(b1, b2, t):
    """``1.0 - powf(beta, iter)``: float powf, double subtraction (kept in float64)."""
    return 1.0 - f64(powf(b1, f32(t))), 1.0 - f64(powf(b2, f32(t)))


def _adam_m(m, g, b1):
    # m_t.mul_(beta1); m_t.fma_(grad, 1.0 - beta1): fma_ takes a float
    return fmaf(g, f32(1.0 - f64(b1)), f32(m * b1))


def adam_row(w, g, st, t, lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0):
    b1, b2, eps, wd = f32(b1), f32(b2), f32(eps), f32(weight_decay)
    m = _adam_m(st["momentum1"], g, b1)
    # v_t.mul_(beta2); grad.sq_(); v_t.fma_(grad, 1.0 - beta2)
    v = fmaf(f32(g * g), f32(1.0 - f64(b2)), f32(st["momentum2"] * b2))
    c1, c2 = _bias_corrections(b1, b2, t)
    # weight_new -= learning_rate * (m_t / (1.0 - powf(beta1, iter)) /
    #     (sqrtf((v_t / (1.0 - powf(beta2, iter)))) + eps) + weight_decay * weight_new)
    den = f32(np.sqrt(f32(f64(v) / c2)) + eps)
    step = f64(m) / c1 / f64(den) + f64(f32(wd * w))
    return f32(f64(w) - f64(lr) * step), {"momentum1": m, "momentum2": v}


def partial_rowwise_adam_row(w, g, st, t, lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0):
    b1, b2, eps, wd = f32(b1), f32(b2), f32(eps), f32(weight_decay)
    g_avg_square = f32(row_sum(f32(g * g)) / f32(w.shape[0]))
    c1, c2 = _bias_corrections(b1, b2, t)
    # auto v_t = g_avg_square * (1.0 - beta2) (a double); v_t += momentum2[idx] * beta2;
    # momentum2[idx] = v_t; v_hat_t = v_t / (1.0 - powf(beta2, iter)) (a float)
    v_t = f64(g_avg_square) * (1.0 - f64(b2)) + f64(f32(st["momentum2"] * b2))
    v_hat_t = f32(v_t / c2)
    m = _adam_m(st["momentum1"], g, b1)
    # weight_new -= learning_rate * (m_t / (1.0 - powf(beta1, iter)) /
    #     (sqrtf(v_hat_t) + eps) + weight_decay * weight_new)
    den = f32(np.sqrt(v_hat_t) + eps)
    step = f64(m) / c1 / f64(den) + f64(f32(wd * w))
    return f32(f64(w) - f64(lr) * step), {"momentum1": m, "momentum2": f32(v_t)}


def _lamb_m1(m1, g, b1):
    # m1 = beta1 * m1 + (1.0 - beta1) * grad: a double sum stored as float
    return f32(f64(f32(b1 * m1)) + (1.0 - f64(b1)) * f64(g))


def _trust_step(w, rtw, lr):
    """``weight_new.fma_(grad, -learning_rate * true_ratio)`` with the norms in float."""
    weight_norm = f32(np.sqrt(row_sum(f32(w * w))))
    rtw_norm = f32(np.sqrt(row_sum(f32(rtw * rtw))))
    # true_ratio = weight_norm / rtw_norm: NaN at rtw_norm == 0, guarded to "no step".
    ratio = f32(weight_norm / rtw_norm) if rtw_norm > 0 else f32(0.0)
    return fmaf(rtw, f32(-lr * ratio), w)


def lamb_row(w, g, st, t, lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0):
    b1, b2, eps, wd = f32(b1), f32(b2), f32(eps), f32(weight_decay)
    m1 = _lamb_m1(st["momentum1"], g, b1)
    # m2 = beta2 * m2 + (1.0 - beta2) * grad * grad: ((1.0 - beta2) * grad) * grad in double
    m2 = f32(f64(f32(b2 * st["momentum2"])) + (1.0 - f64(b2)) * f64(g) * f64(g))
    c1, c2 = _bias_corrections(b1, b2, t)
    # grad = (m1 / (1.0 - powf(beta1, iter))) / (sqrtf((m2 / (1.0 - powf(beta2, iter))))
    #     + eps) + weight_decay * weight, stored as float
    den = f32(np.sqrt(f32(f64(m2) / c2)) + eps)
    rtw = f32(f64(m1) / c1 / f64(den) + f64(f32(wd * w)))
    return _trust_step(w, rtw, lr), {"momentum1": m1, "momentum2": m2}


def partial_rowwise_lamb_row(w, g, st, t, lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0):
    b1, b2, eps, wd = f32(b1), f32(b2), f32(eps), f32(weight_decay)
    g_avg_square = f32(row_sum(f32(g * g)) / f32(w.shape[0]))
    c1, c2 = _bias_corrections(b1, b2, t)
    # m2 = beta2 * momentum2[idx] + (1.0 - beta2) * g_avg_square (a float)
    m2 = f32(f64(f32(b2 * st["momentum2"])) + (1.0 - f64(b2)) * f64(g_avg_square))
    # m2_hat = 1.0 / (sqrtf((m2 / (1.0 - powf(beta2, iter)))) + eps) (a float)
    m2_hat = f32(1.0 / f64(f32(np.sqrt(f32(f64(m2) / c2)) + eps)))
    m1 = _lamb_m1(st["momentum1"], g, b1)
    # grad = (m1 / (1.0 - powf(beta1, iter))) * m2_hat + weight_decay * weight
    rtw = f32(f64(m1) / c1 * f64(m2_hat) + f64(f32(wd * w)))
    return _trust_step(w, rtw, lr), {"momentum1": m1, "momentum2": m2}


def lars_sgd_row(w, g, st, t, lr, eta=0.001, momentum=0.9, weight_decay=0.0):
    eta, momentum, wd = f32(eta), f32(momentum), f32(weight_decay)
    weight_norm = f32(np.sqrt(row_sum(f32(w * w))))
    grad_norm = f32(np.sqrt(row_sum(f32(g * g))))
    # adjusted_lr = learning_rate * eta * weight_norm / (grad_norm + weight_decay * weight_norm)
    denom = f32(grad_norm + f32(wd * weight_norm))
    num = f32(f32(lr * eta) * weight_norm)
    adjusted_lr = f32(num / denom) if denom > 0 else f32(0.0)  # NaN there: guarded
    # m1 = momentum * m1 + adjusted_lr * (grad + weight_decay * weight_new); weight_new -= m1
    m1 = f32(f32(momentum * st["momentum1"]) + f32(adjusted_lr * f32(g + f32(wd * w))))
    return f32(w - m1), {"momentum1": m1}


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


def apply_rows(name, table, state, rows, grads, t, lr, **hyperparams):
    """One step on the touched ``rows`` (ids ``>= num_rows`` skipped), float32 copies.

    Args:
        name: a key of ``ROW_UPDATES``.
        table: ``[R, D]`` float32 weights.
        state: ``{field: [R] or [R, D]}`` float32 state.
        rows: ``[U]`` unique row ids.
        grads: ``[U, D]`` float32 summed gradients.
        t: FBGEMM's ``iter`` (1 on the first step).
        lr: this step's learning rate (rounded to float, as FBGEMM's tensor holds it).
        **hyperparams: the optimizer's keyword hyper-parameters.

    Returns:
        ``(table, state)`` after the step.
    """
    table = np.array(table, f32)
    state = {f: np.array(a, f32) for f, a in state.items()}
    grads = np.asarray(grads, f32)
    lr = f32(lr)
    for i, r in enumerate(np.asarray(rows)):
        if r >= table.shape[0]:
            continue
        st = {f: a[r].copy() if a.ndim == 2 else f32(a[r]) for f, a in state.items()}
        update = ROW_UPDATES[name]
        new_w, new_st = update(table[r].copy(), grads[i].copy(), st, t, lr, **hyperparams)
        assert new_w.dtype == f32, name  # the reference itself stays in float32
        table[r] = new_w
        for f, a in new_st.items():
            state[f][r] = a
    return table, state
