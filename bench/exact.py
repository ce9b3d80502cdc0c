"""Float64 references for ``bench/gpu_lookup.py``, each with a bound on float32 rounding.

A kernel's float32 result differs from the exact one by rounding, and by more
where it is wrong. Comparing two float32 implementations cannot tell these apart
when rows repeat many times (their sums differ by the order of summation alone).
Here every value is computed in float64 from the same float32 inputs, beside a
bound ``e`` on ``|float32 result - exact|`` valid for **any** order of summation
and any fusion of multiply-adds: a result outside its bound is an error, not
rounding.

Each quantity is a :class:`Bounded` ``(x, e)``: ``x`` the float64 value, ``e``
the bound. Inputs (table rows, output gradients, scales, initial state) are
exact. Each operation adds the error its inputs carry through it (``|a|e_b +
|b|e_a + e_a e_b`` for a product, ``(e_a + |a/b|e_b)/(|b| - e_b)`` for a
quotient, ``min(sqrt(e_a), e_a/sqrt(a))`` for a square root) and its own
rounding, ``rel * (|x| + that) + 2**-126``, with ``rel = 2**-24`` (float32's unit
roundoff) for ``+ - *`` and four ulps (``8 * 2**-24``) for ``/`` and ``sqrt``,
which Triton lowers to approximate instructions (``div.full.f32``: 2 ulps);
``2**-126`` allows a result under float32's smallest normal to be flushed to
zero. Storing to an fp16 / bf16 table adds that dtype's unit roundoff, relative,
and half its subnormal spacing, absolute (``TINY``).
A sum of ``n`` terms, in any order or tree, adds ``gamma(n - 1) * sum|terms|``
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 4.4,
``gamma(k) = k u / (1 - k u)``). The float64 reference's own rounding (``2**-53``
per operation, ``n * 2**-53`` per sum) is added to each bound too; it is about
1e-9 of the float32 terms.

So for a row touched ``n`` times with gradient terms ``t_c``, the summed
gradient's bound is ``(u + gamma(n - 1)(1 + u)) * sum|t_c|`` per element, and
the optimizer's update carries it through (the state fields get their own
bounds: a gradient error that Adam's first step normalises away in the table
still shows in its moments). A forward bag of ``L`` ids is bounded the same way.

That worst case grows as ``n**2 u`` for ``n`` terms of similar size: for a row
touched 10^5 times it exceeds the sum itself, and says nothing. Beside it each
quantity carries a *probabilistic* bound, the same but for sums, where
``gamma(n - 1)`` becomes ``expm1(LAMBDA sqrt(n - 1) u + (n - 1) u**2 / (1 - u))``,
about ``LAMBDA * sqrt(n - 1) * u`` (Higham and Mary, "A new approach to
probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019: each
term's product of ``n - 1`` rounding factors is within it with probability at
least ``1 - 2 exp(-LAMBDA**2 (1 - u)**2 / 2)`` if rounding errors are independent
with mean zero, whatever the order; ``LAMBDA = 8``: all ``n`` terms, 1 - 3e-14 n).
An error outside the worst-case bound is certainly not rounding; one outside the
probabilistic bound almost certainly is not. Where they catch one wrong term of
a sum of ``n`` terms of similar size: while ``n**2 u < 1`` (``n`` up to ~4,000)
for the worst case, ``LAMBDA n**1.5 u < 1`` (~16,000) for the probabilistic one;
errors of many terms (a lost piece of a run) beyond. ``Bounded.e`` holds both:
``e[0]`` worst case, ``e[1]`` probabilistic (``BOUNDS``).

``optimizer_step`` implements EXACT_SGD, EXACT_ROWWISE_ADAGRAD and ADAM as
``jaxrec.optim`` computes them (its hyper-parameters rounded to float32, FBGEMM's
``1.0 - beta`` and bias corrections, operations in its order).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp

from jaxrec.optim import EmbOptimType, SparseOptimizer, WeightDecayMode

U32 = 2.0**-24  # float32 unit roundoff
U64 = 2.0**-53  # float64's, the reference's own
APPROX = 8 * U32  # "/" and sqrt: up to four ulps (Triton's div.full.f32 is within two)
FTZ = 2.0**-126  # float32's smallest normal: a GPU may flush results under it to zero
LAMBDA = 8.0  # the probabilistic bound's confidence parameter
BOUNDS = ("worst_case", "probabilistic")  # Bounded.e[0], Bounded.e[1]
UNIT = {"fp32": U32, "fp16": 2.0**-11, "bf16": 2.0**-8}  # storage dtypes' unit roundoffs
# Half the spacing of their subnormals: rounding near zero is absolute, not relative
# (an fp16 table of 1000-row init range 0.03 has values under fp16's 6.1e-5 normal).
TINY = {"fp32": 2.0**-150, "fp16": 2.0**-25, "bf16": 2.0**-134}


class Bounded(NamedTuple):
    """A float64 value ``x`` and bounds ``e`` on the error of its float32 computation:
    ``e[k]`` for each of ``BOUNDS`` (or one bound, of ``x``'s shape, for inputs)."""

    x: np.ndarray
    e: np.ndarray


ZERO = np.zeros(())  # the bound of exact inputs: operations skip it


def exact(x) -> Bounded:
    """An exactly known input (a float32 value, or a hyper-parameter as float32)."""
    return Bounded(np.asarray(x, np.float64), ZERO)


def _exact(e) -> bool:
    return e is ZERO


def gamma(n, u: float = U32):
    """Higham's ``gamma_n = n u / (1 - n u)`` (elementwise for an array ``n``)."""
    nu = np.asarray(n, np.float64) * u
    return np.where(nu < 1, nu / np.maximum(1 - nu, 1e-300), np.inf)


def _rounded(x, delta, rel):
    """The error of an operation's float32 result: what its inputs carried (``delta``)
    plus its own rounding of a value within ``delta`` of ``x`` (and ``FTZ``)."""
    return delta + (rel + U64) * (np.abs(x) + delta) + FTZ


def add(a: Bounded, b: Bounded, rel: float = U32) -> Bounded:
    x = a.x + b.x
    return Bounded(x, _rounded(x, a.e + b.e, rel))


def sub(a: Bounded, b: Bounded, rel: float = U32) -> Bounded:
    x = a.x - b.x
    return Bounded(x, _rounded(x, a.e + b.e, rel))


def mul(a: Bounded, b: Bounded, rel: float = U32) -> Bounded:
    x = a.x * b.x
    if _exact(a.e) and _exact(b.e):
        delta = ZERO
    elif _exact(a.e):
        delta = np.abs(a.x) * b.e
    elif _exact(b.e):
        delta = np.abs(b.x) * a.e
    else:
        delta = np.abs(a.x) * b.e + np.abs(b.x) * a.e + a.e * b.e
    return Bounded(x, _rounded(x, delta, rel))


def div(a: Bounded, b: Bounded, rel: float = APPROX) -> Bounded:
    with np.errstate(divide="ignore", invalid="ignore"):
        x = a.x / b.x
        room = np.abs(b.x) - b.e  # the divisor's distance from zero, at worst
        delta = np.where(room > 0, (a.e + np.abs(x) * b.e) / np.where(room > 0, room, 1), np.inf)
    return Bounded(x, _rounded(x, delta, rel))


def sqrt(a: Bounded, rel: float = APPROX) -> Bounded:
    x = np.sqrt(np.maximum(a.x, 0))
    with np.errstate(divide="ignore", invalid="ignore"):
        delta = np.where(x > 0, np.minimum(np.sqrt(a.e), a.e / np.where(x > 0, x, 1)), np.sqrt(a.e))
    return Bounded(x, _rounded(x, delta, rel))


def _sum_factors(n) -> np.ndarray:
    """``[2, ...]``: the worst-case and probabilistic factors of a sum of ``n`` terms."""
    n = np.asarray(n, np.float64)
    k = np.maximum(n - 1, 0)
    likely = np.expm1(LAMBDA * np.sqrt(k) * U32 + k * U32**2 / (1 - U32))
    return np.stack([gamma(k) + n * U64, likely + n * U64])


def row_sum(a: Bounded) -> Bounded:
    """Sum over the last axis, in any order."""
    n = a.x.shape[-1]
    x, delta = a.x.sum(-1), a.e.sum(-1)
    factors = _sum_factors(n).reshape((2,) + (1,) * x.ndim)
    return Bounded(x, delta + factors * (np.abs(a.x).sum(-1) + delta))


def store(a: Bounded, dtype: str) -> Bounded:
    """The value rounded to a table of ``dtype`` (float32 results are stored as they are):
    relative ``UNIT``, or ``TINY`` absolute among subnormals."""
    if dtype == "fp32":
        return a
    return Bounded(a.x, _rounded(a.x, a.e, UNIT[dtype]) + TINY[dtype])


def column(a: Bounded) -> Bounded:
    """A per-row ``[U]`` quantity broadcast over the columns ``[U, 1]``."""
    return Bounded(a.x[:, None], a.e[..., None])


# ----- sums of gathered rows: the forward bags and the backward's duplicates -----
def bounded_sums(values: np.ndarray, index: np.ndarray, scale: np.ndarray, indptr: np.ndarray):
    """``out[k] = sum_j values[index[j]] * scale[j]`` over ``j`` in ``[indptr[k], indptr[k+1])``.

    Args:
        values: ``[N, D]`` float32 (or any dtype float64 holds exactly).
        index: ``[M]`` rows of ``values``; ``scale``: ``[M]`` float32 multipliers.
        indptr: ``[K + 1]`` nondecreasing, ``indptr[-1] == M``.

    Returns:
        ``Bounded [K, D]``: each product rounded once, each sum of ``n`` terms in any
        order: ``e[0] = (u + gamma(n - 1)(1 + u) + n * 2**-53) * sum_j |values * scale|``
        and ``e[1]`` the same with the probabilistic ``~LAMBDA * sqrt(n - 1) * u`` for
        ``gamma(n - 1)``.
    """
    k, n = len(indptr) - 1, np.diff(indptr)
    used = np.zeros(len(values), bool)  # only the rows these sums read, in float64
    used[index] = True
    v = np.asarray(values[used], np.float64)
    index = (np.cumsum(used) - 1)[index]
    s = np.asarray(scale, np.float64)
    shape = (k, v.shape[0])
    x = sp.csr_matrix((s, index, indptr), shape=shape) @ v
    magnitude = sp.csr_matrix((np.abs(s), index, indptr), shape=shape) @ np.abs(v)
    factors = U32 + _sum_factors(n) * (1 + U32)  # [2, K]
    return Bounded(np.asarray(x), factors[:, :, None] * np.asarray(magnitude)[None])


# ----- optimizer steps -----
def _lr(opt: SparseOptimizer, count: int) -> Bounded:
    lr = opt.learning_rate
    return exact(np.float32(lr(count - 1) if callable(lr) else lr))


def _f32(x) -> Bounded:
    return exact(np.float32(x))


def _one_minus(b) -> np.float32:
    """FBGEMM's ``1.0 - beta`` from the float32 ``beta`` (as ``jaxrec.optim``)."""
    return np.float32(1.0 - np.float64(np.float32(b)))


def _bias_correction(b, count: int) -> Bounded:
    """``1 - powf(beta, t)`` in float32: ``jaxrec.optim`` rounds the power correctly."""
    power = np.float32(np.float64(np.float32(b)) ** count)
    return exact(np.float32(1.0 - np.float64(power)))


def optimizer_step(
    opt: SparseOptimizer, w: Bounded, g: Bounded, state: dict[str, np.ndarray], count: int
) -> tuple[Bounded, dict[str, Bounded]]:
    """One step of ``opt`` on rows ``w [U, D]`` with summed gradients ``g [U, D]``.

    ``state``: the rows' state fields before the step (``momentum1``, ...; exact);
    ``count``: the step number after it (1 on the first step). Returns the new rows
    and state fields, each bounded.
    """
    lr, p = _lr(opt, count), opt.params
    fields = {f: exact(v) for f, v in state.items()}
    if opt.kind is EmbOptimType.EXACT_SGD:
        wd, mode = _f32(p.weight_decay), WeightDecayMode(p.weight_decay_mode)
        if mode is WeightDecayMode.L2:
            g = add(g, mul(wd, w))
        if mode is WeightDecayMode.DECOUPLE:
            w = sub(w, mul(mul(lr, wd), w))
        return sub(w, mul(lr, g)), {}
    if opt.kind is EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        wd, mode, d = _f32(p.weight_decay), WeightDecayMode(p.weight_decay_mode), w.x.shape[-1]
        g2 = add(g, mul(wd, w)) if mode is WeightDecayMode.L2 else g
        m = add(fields["momentum1"], div(row_sum(mul(g2, g2)), exact(d)))
        mult = column(div(lr, add(sqrt(m), _f32(p.eps))))
        if mode is WeightDecayMode.L2:
            w = mul(sub(exact(1.0), mul(mult, wd)), w)
        elif mode is WeightDecayMode.DECOUPLE:
            w = mul(sub(exact(1.0), mul(lr, wd)), w)
        return sub(w, mul(mult, g)), {"momentum1": m}
    if opt.kind is EmbOptimType.ADAM:
        b1, b2 = np.float32(p.b1), np.float32(p.b2)
        c1, c2 = _bias_correction(b1, count), _bias_correction(b2, count)
        m = add(mul(fields["momentum1"], exact(b1)), mul(g, exact(_one_minus(b1))))
        v = add(mul(fields["momentum2"], exact(b2)), mul(mul(g, g), exact(_one_minus(b2))))
        step = div(div(m, c1), add(sqrt(div(v, c2)), _f32(p.eps)))
        rtw = add(step, mul(_f32(p.weight_decay), w))
        return sub(w, mul(lr, rtw)), {"momentum1": m, "momentum2": v}
    raise NotImplementedError(f"no float64 reference for {opt.name}")


# ----- comparing -----
@dataclasses.dataclass
class Check:
    """Running comparison of float32 results with their float64 references, against
    both bounds (``BOUNDS``; counts and maxima per bound in that order)."""

    elements: int = 0
    max_abs_err: float = 0.0
    max_bound: list = dataclasses.field(default_factory=lambda: [0.0, 0.0])  # largest finite
    err_over_bound: list = dataclasses.field(default_factory=lambda: [0.0, 0.0])
    outside: list = dataclasses.field(default_factory=lambda: [0, 0])  # errors over the bound
    unbounded: list = dataclasses.field(default_factory=lambda: [0, 0])  # infinite bounds

    def add(self, got, ref: Bounded) -> None:
        """Compares ``got`` (any float dtype) with ``ref`` (``e`` of shape ``[2, *x.shape]``)."""
        got = np.asarray(got, np.float64)
        err = np.abs(got - ref.x)
        err = np.where(np.isnan(got), np.inf, err)
        self.elements += err.size
        if not err.size:
            return
        self.max_abs_err = max(self.max_abs_err, float(err.max()))
        bounds = ref.e if np.ndim(ref.e) == err.ndim + 1 else [ref.e] * len(BOUNDS)
        for k in range(len(BOUNDS)):
            e = np.broadcast_to(bounds[k], err.shape)
            finite = np.isfinite(e)
            if finite.any():
                self.max_bound[k] = max(self.max_bound[k], float(e[finite].max()))
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(err > 0, err / e, 0.0)
            self.err_over_bound[k] = max(self.err_over_bound[k], float(np.nanmax(ratio)))
            self.outside[k] += int(np.count_nonzero(err > e))
            self.unbounded[k] += int(np.count_nonzero(~finite))

    def merge(self, other: Check) -> Check:
        """This and ``other`` together (chunks compared apart)."""
        self.elements += other.elements
        self.max_abs_err = max(self.max_abs_err, other.max_abs_err)
        for k in range(len(BOUNDS)):
            self.max_bound[k] = max(self.max_bound[k], other.max_bound[k])
            self.err_over_bound[k] = max(self.err_over_bound[k], other.err_over_bound[k])
            self.outside[k] += other.outside[k]
            self.unbounded[k] += other.unbounded[k]
        return self

    @property
    def within_bound(self) -> bool:
        """No error outside the worst-case bound: every difference is rounding."""
        return self.outside[0] == 0

    @property
    def within_probabilistic_bound(self) -> bool:
        return self.outside[1] == 0

    def record(self) -> dict:
        """Flat JSON fields: ``bound_*`` worst case, ``prob_bound_*`` probabilistic."""
        out = {"checked_elements": self.elements, "max_abs_err": _json(self.max_abs_err)}
        for k, name in enumerate(("bound", "prob_bound")):
            out[f"max_{name}"] = self.max_bound[k]
            out[f"err_over_{name}"] = _json(self.err_over_bound[k])
            out[f"outside_{name}"] = self.outside[k]
            out[f"unbounded_{name}"] = self.unbounded[k]
        out["within_bound"] = self.within_bound
        out["within_prob_bound"] = self.within_probabilistic_bound
        return out


def _json(x: float):
    """JSON has no infinity: ``"inf"`` for it, the float otherwise."""
    return x if math.isfinite(x) else "inf"
