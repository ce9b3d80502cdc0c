"""FBGEMM's fused embedding optimizers (``EmbOptimType``) as row-wise updates.

Every factory returns a :class:`SparseOptimizer`. Formulas follow FBGEMM's
``fbgemm_gpu/codegen/genscript/optimizers.py`` (``split_precomputation`` +
``split_weight_update``; quoted in each docstring); ``g`` is the row's gradient
summed over every occurrence in the batch, ``w`` the row before the update,
``t`` the table group's step count (FBGEMM's ``iter``, 1 on the first step).
State is float32 whatever the table dtype.

Rounding follows FBGEMM's float kernels: hyper-parameters are float32 (as its
``float`` arguments), ``1 - beta`` is taken from the rounded ``beta``, bias
corrections are ``1 - powf(beta, t)`` with a correctly rounded float32 ``powf``,
and each expression keeps FBGEMM's order. FBGEMM keeps some terms in double
(C++'s ``1.0`` literal) and fuses some multiply-adds; jaxrec rounds in float32,
which agrees with a model of FBGEMM's rounding to a few float32 ulps over
several steps (``tests/optim/test_fbgemm_rounding.py``).

Not carried over from FBGEMM: stochastic rounding of fp16/bf16 tables (jaxrec
rounds to nearest), ``gradient_clipping``, row-wise Adagrad's ``max_norm``
post-update and counter-based modes, and Adam's ``use_rowwise_bias_correction``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .base import EmbOptimType, ScalarOrSchedule, SparseOptimizer, WeightDecayMode, lr_at


def _mode(mode) -> WeightDecayMode:
    """``mode`` as a :class:`WeightDecayMode` (a member or its value, e.g. ``"L2"``)."""
    try:
        return WeightDecayMode(mode)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in WeightDecayMode)
        raise ValueError(
            f"weight_decay_mode={mode!r} is not a WeightDecayMode; pass WeightDecayMode.NONE, "
            f".L2 or .DECOUPLE (or one of {choices})."
        ) from None


def _decayed_grad(g, w, weight_decay, mode):
    return g + weight_decay * w if mode is WeightDecayMode.L2 else g


def _decoupled(w, lr, weight_decay, mode):
    return w - lr * weight_decay * w if mode is WeightDecayMode.DECOUPLE else w


def _row_sum(x, row_sum):
    """Sum over the last axis; ``row_sum`` completes it across column shards of a row."""
    s = jnp.sum(x, axis=-1)
    return s if row_sum is None else row_sum(s)


def _norm(x, row_sum=None):
    return jnp.sqrt(_row_sum(x * x, row_sum))[:, None]


def _row_mean(x, dim, row_sum=None):
    """Mean over the logical row: ``dim`` is its width when rows are zero-padded or split
    by columns (an int or a ``[U]`` array), ``row_sum`` adds the other shards' sums."""
    if dim is None and row_sum is None:
        return jnp.mean(x, axis=-1)
    return _row_sum(x, row_sum) / (x.shape[-1] if dim is None else dim)


# ----- SGD -----
class SgdState(NamedTuple):
    count: jax.Array


class SgdParams(NamedTuple):
    """:func:`sgd`'s hyper-parameters (besides the learning rate)."""

    weight_decay: float
    weight_decay_mode: WeightDecayMode


def sgd(
    learning_rate: ScalarOrSchedule,
    weight_decay: float = 0.0,
    weight_decay_mode: WeightDecayMode = WeightDecayMode.NONE,
) -> SparseOptimizer:
    """EXACT_SGD: ``w -= lr * g``.

    FBGEMM (``sgd``): ``weight_new.fma_(grad, -learning_rate)``. FBGEMM's SGD
    takes no weight decay (its TBE ignores ``weight_decay`` here); jaxrec adds it
    as an extension, off by default: L2 ``g += wd*w`` (as ``torch.optim.SGD``),
    DECOUPLE ``w -= lr*wd*w`` beside the step.
    """
    mode = _mode(weight_decay_mode)

    def init(num_rows, dim):
        del num_rows, dim
        return SgdState(count=jnp.zeros((), jnp.int32))

    def update(w, g, state, count, *, dim=None, row_sum=None):
        lr = lr_at(learning_rate, count)
        g = _decayed_grad(g, w, weight_decay, mode)
        return _decoupled(w, lr, weight_decay, mode) - lr * g, state

    params = SgdParams(weight_decay, mode)
    return SparseOptimizer(init, update, EmbOptimType.EXACT_SGD, learning_rate, params)


# ----- Adagrad -----
class AdagradState(NamedTuple):
    count: jax.Array
    momentum1: jax.Array  # [rows, dim] sum of squared gradients


class AdagradParams(NamedTuple):
    """:func:`adagrad`'s and :func:`rowwise_adagrad`'s hyper-parameters (besides the
    learning rate)."""

    eps: float
    weight_decay: float
    weight_decay_mode: WeightDecayMode


def adagrad(
    learning_rate: ScalarOrSchedule,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mode: WeightDecayMode = WeightDecayMode.NONE,
) -> SparseOptimizer:
    """EXACT_ADAGRAD: ``m += g*g``; ``w -= lr * g / (sqrt(m) + eps)`` (eps outside the sqrt).

    FBGEMM (``adagrad``): ``m_t += grad * grad;``
    ``weight_new -= learning_rate * grad / (sqrtf(m_t) + eps)``. FBGEMM's Adagrad
    takes no weight decay; jaxrec adds it as an extension, off by default: L2
    ``g += wd*w`` before both lines (as ``torch.optim.Adagrad``), DECOUPLE
    ``w -= lr*wd*w`` beside the step.
    """
    mode = _mode(weight_decay_mode)

    def init(num_rows, dim):
        return AdagradState(jnp.zeros((), jnp.int32), jnp.zeros((num_rows, dim), jnp.float32))

    def update(w, g, state, count, *, dim=None, row_sum=None):
        lr = lr_at(learning_rate, count)
        g = _decayed_grad(g, w, weight_decay, mode)
        m = state.momentum1 + g * g
        w = _decoupled(w, lr, weight_decay, mode) - lr * g / (jnp.sqrt(m) + eps)
        return w, state._replace(momentum1=m)

    params = AdagradParams(eps, weight_decay, mode)
    return SparseOptimizer(init, update, EmbOptimType.EXACT_ADAGRAD, learning_rate, params)


# ----- Row-wise Adagrad -----
class RowwiseAdagradState(NamedTuple):
    count: jax.Array
    momentum1: jax.Array  # [rows] one accumulator per row


def rowwise_adagrad(
    learning_rate: ScalarOrSchedule,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mode: WeightDecayMode = WeightDecayMode.NONE,
) -> SparseOptimizer:
    """EXACT_ROWWISE_ADAGRAD, one accumulator per row.

    ``g2 = g + wd*w`` (L2) else ``g``; ``m += mean_d(g2*g2)``;
    ``mult = lr / (sqrt(m) + eps)``; ``w = c*w - mult*g`` with the raw ``g``,
    where ``c = 1 - mult*wd`` (L2), ``1 - lr*wd`` (DECOUPLE), ``1`` (NONE).

    FBGEMM (``rowwise_adagrad``): ``g_avg_square = sum(gx*gx, ...) / D`` (``gx +=
    weight_decay * weight.x`` when ``weight_decay_mode == 1``);
    ``multiplier = learning_rate / (sqrtf(new_sum_square_grads) + eps)``;
    ``correction = 1.0 - multiplier * weight_decay`` (mode 1),
    ``1.0 - learning_rate * weight_decay`` (mode 2), else ``1.0``;
    ``weight_new = correction * weight_new - multiplier * grad``.
    """
    mode = _mode(weight_decay_mode)

    def init(num_rows, dim):
        del dim
        return RowwiseAdagradState(jnp.zeros((), jnp.int32), jnp.zeros((num_rows,), jnp.float32))

    def update(w, g, state, count, *, dim=None, row_sum=None):
        lr = lr_at(learning_rate, count)
        g2 = _decayed_grad(g, w, weight_decay, mode)
        m = state.momentum1 + _row_mean(g2 * g2, dim, row_sum)
        mult = (lr / (jnp.sqrt(m) + eps))[:, None]
        if mode is WeightDecayMode.L2:
            c = 1.0 - mult * weight_decay
        elif mode is WeightDecayMode.DECOUPLE:
            c = 1.0 - lr * weight_decay
        else:
            c = 1.0
        return c * w - mult * g, state._replace(momentum1=m)

    params = AdagradParams(eps, weight_decay, mode)
    kind = EmbOptimType.EXACT_ROWWISE_ADAGRAD
    return SparseOptimizer(init, update, kind, learning_rate, params)


# ----- Adam family -----
class AdamState(NamedTuple):
    count: jax.Array
    momentum1: jax.Array  # [rows, dim]
    momentum2: jax.Array  # [rows, dim], or [rows] for the partial row-wise variants


class AdamParams(NamedTuple):
    """The Adam family's hyper-parameters (besides the learning rate): :func:`adam`,
    :func:`partial_rowwise_adam`, :func:`lamb`, :func:`partial_rowwise_lamb`."""

    b1: float
    b2: float
    eps: float
    weight_decay: float


def _one_minus(b):
    """FBGEMM's ``1.0 - beta`` for a float ``beta``: ``beta`` rounded to float32 first.

    ``1.0 - 0.999`` rounded once (Python) differs from ``1.0 - float(0.999)`` by
    1.3e-5 relative; FBGEMM subtracts from the float, exactly for ``beta >= 0.5``.
    """
    return np.float32(1.0 - np.float64(np.float32(b)))


_ROUND_12, _KEEP_12 = 0x800, 0xFFFFF000  # round a float32's bits to 12 significant bits


def _split(a):
    """``a = hi + lo`` exactly, ``hi`` rounded to 12 significant bits through the bit
    pattern, so that no multiply-add the compiler fuses can change it."""
    bits = lax.bitcast_convert_type(a, jnp.uint32)
    hi = lax.bitcast_convert_type((bits + np.uint32(_ROUND_12)) & np.uint32(_KEEP_12), a.dtype)
    return hi, a - hi


def _split_host(x):
    """:func:`_split` of a host float32."""
    bits = np.array(x, np.float32).view(np.uint32)
    hi = np.array((int(bits) + _ROUND_12) & _KEEP_12, np.uint32).view(np.float32)[()]
    return hi, np.float32(x) - hi


def _two_float_mul(xh, xl, y):
    """``(xh + xl) * y`` for a host factor ``y = (hi, lo, hi's 12-bit halves)``, as a
    normalised float32 pair (about 44 bits).

    Dekker's exact product of ``xh * y_hi``: every product of halves is exact, so
    fused multiply-adds leave it unchanged. The host factor is split on the host
    (Pallas' Triton lowering cannot bitcast a constant).
    """
    yh, yl, bh, bl = y
    p = xh * yh
    ah, al = _split(xh)
    e = al * bl - (((p - ah * bh) - al * bh) - ah * bl)
    e = e + (xh * yl + xl * yh)
    s = p + e
    return s, e - (s - p)


def _powers_of_two(beta):
    """Host float32 factors ``beta ** (2 ** k)`` as ``(hi, lo, hi_hi, hi_lo)`` (``hi + lo``
    the power, ``hi_hi + hi_lo`` the 12-bit split of ``hi``), from ``k = 0`` while the
    power is a normal float32 (at most 31: ``count`` is int32)."""
    b = float(np.float32(beta))
    factors = []
    for k in range(31):
        x = b if k == 0 or b == 0 else math.exp(2.0**k * math.log(abs(b)))
        if not 2.0**-100 < abs(x) < 2.0**100:
            break
        hi = np.float32(x)
        factors.append((hi, np.float32(x - float(hi)), *_split_host(hi)))
    return factors


def _powf(beta, factors, count):
    """FBGEMM's ``powf(beta, iter)`` for the int32 step ``count``, correctly rounded.

    XLA's float32 ``pow`` is not (on CPU 0.9999 ** 508 is one ulp off), and an ulp
    of ``powf`` is ``ulp / (1 - powf)`` of Adam's step: tens of ulps early on.
    Here the product of the powers of two in ``count``'s bits, in two-float
    arithmetic, rounded once.
    """
    b = float(np.float32(beta))
    if abs(b) == 1.0 or not factors:  # factors of +-1 (XLA's CPU compiler fails on that chain)
        one = np.float32(1.0 if b > 0 else 0.0)  # 0 ** t = 0 for t >= 1
        odd_sign = np.float32(-1.0 if b < 0 else one)
        return jnp.where(count == 0, np.float32(1.0), jnp.where((count & 1) == 1, odd_sign, one))
    # The first factor needs no product (and the accumulator must be traced to be split).
    take = (count & 1) == 1
    hi = jnp.where(take, factors[0][0], np.float32(1.0))
    lo = jnp.where(take, factors[0][1], np.float32(0.0))
    for k, factor in enumerate(factors[1:], start=1):
        ph, pl = _two_float_mul(hi, lo, factor)
        take = ((count >> k) & 1) == 1
        hi, lo = jnp.where(take, ph, hi), jnp.where(take, pl, lo)
    if len(factors) < 31:  # beta ** 2**len(factors) under- or overflows float32
        beyond = np.float32(0.0 if abs(b) < 1 else np.inf)
        hi = jnp.where(count >= 2 ** len(factors), beyond, hi)
    return hi


def _bias_correction(beta, factors, count):
    """``1.0 - powf(beta, iter)``: exact in float32 while ``powf(...) >= 0.5`` (FBGEMM
    keeps it in double; it is small, and amplifies any error, exactly then)."""
    return 1.0 - _powf(beta, factors, count.astype(jnp.int32))


def _adam_family(kind, learning_rate, b1, b2, eps, weight_decay, rowwise_v, lamb):
    params = AdamParams(b1, b2, eps, weight_decay)
    # Hyper-parameters as FBGEMM's float kernel arguments, and its ``1.0 - beta`` terms.
    b1, b2, eps, wd = (np.float32(x) for x in (b1, b2, eps, weight_decay))
    one_minus_b1, one_minus_b2 = _one_minus(b1), _one_minus(b2)
    factors1, factors2 = _powers_of_two(b1), _powers_of_two(b2)

    def init(num_rows, dim):
        v_shape = (num_rows,) if rowwise_v else (num_rows, dim)
        return AdamState(
            jnp.zeros((), jnp.int32),
            jnp.zeros((num_rows, dim), jnp.float32),
            jnp.zeros(v_shape, jnp.float32),
        )

    def update(w, g, state, count, *, dim=None, row_sum=None):
        lr = lr_at(learning_rate, count)
        c1, c2 = _bias_correction(b1, factors1, count), _bias_correction(b2, factors2, count)
        # m_t.mul_(beta1); m_t.fma_(grad, 1.0 - beta1) (one rounding there, two here)
        m = state.momentum1 * b1 + g * one_minus_b1
        g2 = _row_mean(g * g, dim, row_sum) if rowwise_v else g * g
        v = state.momentum2 * b2 + g2 * one_minus_b2
        v_hat = (v / c2)[:, None] if rowwise_v else v / c2
        if lamb and rowwise_v:
            # m2_hat = 1.0 / (sqrtf(m2 / (1.0 - powf(beta2, iter))) + eps);
            # grad = (m1 / (1.0 - powf(beta1, iter))) * m2_hat + weight_decay * weight
            rtw = m / c1 * (1.0 / (jnp.sqrt(v_hat) + eps)) + wd * w
        else:
            # m_t / (1.0 - powf(beta1, iter)) / (sqrtf(v_t / (1.0 - powf(beta2, iter))) + eps)
            #     + weight_decay * weight
            rtw = m / c1 / (jnp.sqrt(v_hat) + eps) + wd * w
        if lamb:
            # Trust ratio ||w|| / ||r|| per row, unguarded in FBGEMM: ||w|| = 0 gives 0
            # (the row stays put, as there); ||r|| = 0 gives inf * 0 = NaN there, 0 here.
            w_norm, r_norm = _norm(w, row_sum), _norm(rtw, row_sum)
            ratio = jnp.where(r_norm > 0, w_norm / jnp.where(r_norm > 0, r_norm, 1.0), 0.0)
            # weight_new.fma_(grad, -learning_rate * true_ratio): the scalar first
            return w - (lr * ratio) * rtw, state._replace(momentum1=m, momentum2=v)
        # weight_new -= learning_rate * (...)
        return w - lr * rtw, state._replace(momentum1=m, momentum2=v)

    return SparseOptimizer(init, update, kind, learning_rate, params)


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> SparseOptimizer:
    """ADAM, lazy (touched rows only), bias-corrected with the group's step count ``t``.

    ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g*g``;
    ``w -= lr * (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd*w)``.

    FBGEMM (``adam``): ``weight_new -= learning_rate * (m_t / (1.0 - powf(beta1,
    iter)) / (sqrtf((v_t / (1.0 - powf(beta2, iter)))) + eps) + weight_decay *
    weight_new)``. ``weight_decay`` is always on (decoupled-style, scaled by ``lr``).
    """
    return _adam_family(EmbOptimType.ADAM, learning_rate, b1, b2, eps, weight_decay, False, False)


def partial_rowwise_adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> SparseOptimizer:
    """PARTIAL_ROWWISE_ADAM: Adam with a row-wise second moment.

    ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*mean_d(g*g)`` (``v`` is ``[rows]``);
    ``w -= lr * (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd*w)``.

    FBGEMM (``partial_rowwise_adam``): ``v_t = g_avg_square * (1.0 - beta2) +
    momentum2[idx] * beta2``; ``v_hat_t = v_t / (1.0 - powf(beta2, iter))``;
    ``weight_new -= learning_rate * (m_t / (1.0 - powf(beta1, iter)) /
    (sqrtf(v_hat_t) + eps) + weight_decay * weight_new)``.
    """
    return _adam_family(
        EmbOptimType.PARTIAL_ROWWISE_ADAM, learning_rate, b1, b2, eps, weight_decay, True, False
    )


def lamb(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> SparseOptimizer:
    """LAMB: the Adam update scaled per row by the trust ratio ``||w|| / ||r||``.

    ``m``, ``v`` as in :func:`adam`; ``r = m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps)
    + wd*w``; ``w -= lr * (||w||/||r||) * r``.

    FBGEMM (``lamb``): ``grad = (m1 / (1.0 - powf(beta1, iter))) / (sqrtf((m2 /
    (1.0 - powf(beta2, iter)))) + eps) + weight_decay * weight``;
    ``true_ratio = weight_norm / rtw_norm``;
    ``weight_new.fma_(grad, -learning_rate * true_ratio)``. Zero norms as there
    where that is finite: a row with ``||w|| = 0`` (e.g. zero-initialised) never
    moves. Guarded where FBGEMM gives NaN: ``||r|| = 0`` (e.g. a zero gradient on
    a row's first step with ``wd = 0``) leaves the row unchanged.
    """
    return _adam_family(EmbOptimType.LAMB, learning_rate, b1, b2, eps, weight_decay, False, True)


def partial_rowwise_lamb(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> SparseOptimizer:
    """PARTIAL_ROWWISE_LAMB: LAMB with a row-wise second moment.

    ``v = b2*v + (1-b2)*mean_d(g*g)`` (``[rows]``), otherwise as :func:`lamb`
    (same zero-norm handling).

    FBGEMM (``partial_rowwise_lamb``): ``m2 = beta2 * momentum2[idx] + (1.0 -
    beta2) * g_avg_square``; ``m2_hat = 1.0 / (sqrtf((m2 / (1.0 - powf(beta2,
    iter)))) + eps)``; ``grad = (m1 / (1.0 - powf(beta1, iter))) * m2_hat +
    weight_decay * weight``; ``weight_new.fma_(grad, -learning_rate * true_ratio)``.
    """
    return _adam_family(
        EmbOptimType.PARTIAL_ROWWISE_LAMB, learning_rate, b1, b2, eps, weight_decay, True, True
    )


# ----- LARS-SGD -----
class LarsSgdState(NamedTuple):
    count: jax.Array
    momentum1: jax.Array  # [rows, dim]


class LarsSgdParams(NamedTuple):
    """:func:`lars_sgd`'s hyper-parameters (besides the learning rate)."""

    eta: float
    momentum: float
    weight_decay: float


def lars_sgd(
    learning_rate: ScalarOrSchedule,
    eta: float = 0.001,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
) -> SparseOptimizer:
    """LARS_SGD: per-row adaptive rate with momentum.

    ``lr_row = lr * eta * ||w|| / (||g|| + wd*||w||)``;
    ``m = momentum*m + lr_row*(g + wd*w)``; ``w -= m``.

    FBGEMM (``lars_sgd``): ``adjusted_lr = learning_rate * eta * weight_norm /
    (grad_norm + weight_decay * weight_norm)``; ``m1 = momentum * m1 +
    adjusted_lr * (grad + weight_decay * weight_new)``; ``weight_new -= m1``.
    ``||w|| = 0`` gives ``lr_row = 0`` as there. Guarded where FBGEMM gives NaN:
    a zero denominator (``||g|| = 0`` and ``wd*||w|| = 0``) uses ``lr_row = 0``,
    so ``m = momentum*m``.
    """

    def init(num_rows, dim):
        return LarsSgdState(jnp.zeros((), jnp.int32), jnp.zeros((num_rows, dim), jnp.float32))

    def update(w, g, state, count, *, dim=None, row_sum=None):
        lr = lr_at(learning_rate, count)
        w_norm, g_norm = _norm(w, row_sum), _norm(g, row_sum)
        denom = g_norm + weight_decay * w_norm
        row_lr = jnp.where(denom > 0, lr * eta * w_norm / jnp.where(denom > 0, denom, 1), 0.0)
        m = momentum * state.momentum1 + row_lr * (g + weight_decay * w)
        return w - m, state._replace(momentum1=m)

    params = LarsSgdParams(eta, momentum, weight_decay)
    return SparseOptimizer(init, update, EmbOptimType.LARS_SGD, learning_rate, params)
