"""bench/exact.py and bench/lookup_checks.py: float64 references whose bounds hold for
any summation order and catch a real error (a dropped duplicate, a dropped id)."""

import exact
import jax.numpy as jnp
import lookup_checks
import numpy as np
import pytest

from jaxrec import optim
from jaxrec.xla.backward import backward_update_xla

OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.01),
    "sgd_l2": lambda: optim.sgd(0.01, weight_decay=0.1, weight_decay_mode="L2"),
    "sgd_decouple": lambda: optim.sgd(0.01, weight_decay=0.1, weight_decay_mode="DECOUPLE"),
    "rowwise_adagrad": lambda: optim.rowwise_adagrad(0.01, eps=1e-8),
    "rowwise_adagrad_l2": lambda: optim.rowwise_adagrad(
        0.01, weight_decay=0.1, weight_decay_mode="L2"
    ),
    "rowwise_adagrad_decouple": lambda: optim.rowwise_adagrad(
        0.01, weight_decay=0.1, weight_decay_mode="DECOUPLE"
    ),
    "adam": lambda: optim.adam(0.001),
    "adam_wd": lambda: optim.adam(0.001, weight_decay=0.01),
}
R, D, S, C = 64, 16, 256, 4096  # ids on 40 rows: ~100 duplicates a row


@pytest.fixture(scope="module")
def workload():
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 40, C)
    seg = np.sort(rng.integers(0, S, C))  # bags in order, as the kernels' layout
    lengths = np.bincount(seg, minlength=S)
    scale = rng.random(C, dtype=np.float32)
    h = lookup_checks.host_batch(rows, seg, lengths, scale, mean=False)
    out_grad = rng.standard_normal((S, D)).astype(np.float32)
    table = ((rng.random((R, D), dtype=np.float32) - 0.5) * 0.06).astype(np.float32)
    return h, out_grad, table, rng.permutation(C)


def _xla_step(opt, h, out_grad, table, order=None, valid=None):
    """jaxrec's XLA backward + update in float32, ids taken in ``order``."""
    order = np.arange(C) if order is None else order
    valid = np.ones(C, bool) if valid is None else valid
    t, st = backward_update_xla(
        opt,
        jnp.asarray(table),
        opt.init(R, D),
        jnp.asarray(out_grad),
        jnp.asarray(h.seg[order]),
        jnp.asarray(h.bwd_scale[order]),
        jnp.asarray(h.rows[order].astype(np.int32)),
        jnp.asarray(valid[order]),
    )
    return np.asarray(t), st


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_update_bound_holds_for_any_order_and_flags_a_dropped_duplicate(workload, name):
    h, out_grad, table, perm = workload
    opt = OPTIMIZERS[name]()
    chk = lookup_checks.choose(h, 1 << 10, seed=0)
    assert len(chk.rows) == 40 and h.counts.min() > 50
    sums = lookup_checks.gradient_sums(h, chk, out_grad)
    fields = lookup_checks.state_fields(opt.init(1, D))

    def got(t, st):
        return (t[chk.rows], {f: np.asarray(getattr(st, f))[chk.rows] for f in fields})

    dropped = np.ones(C, bool)
    dropped[h.order[h.ptr[7]]] = False  # one id of the 8th row
    runs = {
        "as_given": got(*_xla_step(opt, h, out_grad, table)),
        "reordered": got(*_xla_step(opt, h, out_grad, table, order=perm)),
        "dropped": got(*_xla_step(opt, h, out_grad, table, valid=dropped)),
    }
    # the reordering changes float32 results: the test is not comparing a sum with itself
    moved = [runs["as_given"][1][f] for f in fields] + [runs["as_given"][0]]
    again = [runs["reordered"][1][f] for f in fields] + [runs["reordered"][0]]
    assert any(not np.array_equal(a, b) for a, b in zip(moved, again, strict=True))
    checks = lookup_checks.check_update(opt, opt.init(1, D), "fp32", table[chk.rows], sums, runs)
    summary = lookup_checks.summary(checks, ("as_given", "reordered", "dropped"))
    assert summary["within_bound"] == {"as_given": True, "reordered": True, "dropped": False}
    assert summary["within_prob_bound"]["reordered"] and not summary["within_prob_bound"]["dropped"]
    # rounding sits well inside the bound; the dropped id far outside it
    assert max(c.err_over_bound[0] for (i, _), c in checks.items() if i == "reordered") < 0.2
    assert max(c.err_over_bound[0] for (i, _), c in checks.items() if i == "dropped") > 10
    assert all(c.unbounded == [0, 0] for c in checks.values())


def test_forward_bound_flags_a_dropped_id_not_a_reordered_bag(workload):
    h, _, table, _ = workload
    chk = lookup_checks.choose(h, 1 << 10, seed=0)
    values = table[chk.fwd_rows]
    terms = table[h.rows] * h.scale[:, None]
    bags = np.split(np.arange(C), h.ends[:-1])
    sums = np.stack([terms[b].sum(0, dtype=np.float32) for b in bags])
    reversed_ = np.stack([np.cumsum(terms[b[::-1]], 0, dtype=np.float32)[-1] for b in bags])
    assert not np.array_equal(sums, reversed_)
    wrong = sums.copy()
    big = int(np.argmax(h.ends - h.starts))
    wrong[big] -= terms[h.starts[big]]  # its first id left out
    got = {"sum": sums[chk.bags], "reversed": reversed_[chk.bags], "wrong": wrong[chk.bags]}
    checks = lookup_checks.check_forward(h, chk, values, False, "fp32", got)
    within = lookup_checks.summary(checks, ())["within_bound"]
    assert within == {"reversed": True, "sum": True, "wrong": False}


def test_sequence_must_be_exact(workload):
    h, _, table, _ = workload
    chk = lookup_checks.choose(h, 1 << 10, seed=0)
    rows = table[h.rows[chk.positions]]
    off = rows.copy()
    off[3, 2] = np.nextafter(off[3, 2], np.float32(1))
    checks = lookup_checks.check_sequence(chk, table[chk.fwd_rows], {"ok": rows, "off": off})
    assert lookup_checks.summary(checks, ())["within_bound"] == {"off": False, "ok": True}


def test_bounded_operations_cover_float32():
    """Each operation's float32 result lies within its bound of the float64 value."""
    rng = np.random.default_rng(1)
    a32, b32 = rng.standard_normal((2, 1000)).astype(np.float32)
    a, b = exact.exact(a32), exact.exact(np.abs(b32) + np.float32(0.5))
    cases = {
        "add": (exact.add(a, b), a32 + (np.abs(b32) + np.float32(0.5))),
        "mul": (exact.mul(a, b), a32 * (np.abs(b32) + np.float32(0.5))),
        "div": (exact.div(a, b), a32 / (np.abs(b32) + np.float32(0.5))),
        "sqrt": (exact.sqrt(b), np.sqrt(np.abs(b32) + np.float32(0.5))),
    }
    chained = exact.div(exact.mul(a, a), exact.add(exact.sqrt(b), exact.exact(np.float32(1e-8))))
    b_32 = np.abs(b32) + np.float32(0.5)
    cases["chained"] = (chained, (a32 * a32) / (np.sqrt(b_32) + np.float32(1e-8)))
    for name, (ref, got) in cases.items():
        assert got.dtype == np.float32, name
        err = np.abs(got.astype(np.float64) - ref.x)
        assert np.all(err <= ref.e[0] if np.ndim(ref.e) == 2 else err <= ref.e), name
    # a divisor within its error of zero: no finite bound
    tiny = exact.Bounded(np.array([1e-9]), np.array([[1e-8], [1e-8]]))
    assert np.isinf(exact.div(exact.exact([1.0]), tiny).e).all()
