"""The fused backward's load-balanced schedule: bounded work per program, exact sums.

Structural tests read the plan (``jaxrec.pallas.runs``) at a realistic batch
size without running a kernel: for uniform and Zipf ids, no program of any
launch walks more than one piece of one run, nor much more than its launch's
mean, while the old schedule (one program per run) grows with the hottest
row. A numpy executor of the plan checks that its pieces partition every run.
The kernels themselves run interpreted against the float64 numpy optimizers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_optimizers as ref
import pytest

from jaxrec import optim
from jaxrec.pallas import fused_backward_update
from jaxrec.pallas.runs import piece_layout, plan_runs, program_loads

BLOCK = 8
PIECE = 32


def _ids(dist, n, rows, rng):
    if dist == "uniform":
        return rng.integers(0, rows, n)
    ranks = np.minimum(rng.zipf(dist, n) - 1, rows - 1)
    return rng.permutation(rows)[ranks]  # hot rows anywhere in the table


def _plan(ids, valid, piece_len, num_rows):
    c = ids.shape[0]
    layout = piece_layout(c, piece_len)
    seg = np.arange(c, dtype=np.int32)
    plan = jax.jit(plan_runs, static_argnums=(4, 5))(
        jnp.asarray(ids, jnp.int32), jnp.asarray(valid), seg, jnp.ones(c), num_rows, layout
    )
    return layout, plan


def _execute(plan, layout, values):
    """The kernels' sums in numpy: per-occurrence ``values`` (sorted order via ``src``)."""
    occ = values[np.asarray(plan.src)] * np.asarray(plan.scale)
    partial = np.zeros(layout.total)
    for level, (pieces, offset) in enumerate(zip(plan.levels, layout.offsets, strict=True)):
        items = occ if level == 0 else partial
        starts, lengths = np.asarray(pieces.start), np.asarray(pieces.length)
        for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
            if n:
                assert n <= layout.piece_len
                partial[offset + i] = items[s : s + n].sum()
    sums = {}
    runs = [np.asarray(x) for x in (plan.row, plan.start, plan.length, plan.partial)]
    for r, s, n, p in zip(*runs, strict=True):
        if n:
            sums[int(r)] = (partial if p else occ)[s : s + n].sum()
    return sums


@pytest.mark.parametrize("c", [1, 2, 32, 33, 1024, 1025, 10_000_000])
@pytest.mark.parametrize("p", [2, 4, 32])
def test_layout_bounds_every_run(c, p):
    """After the levels no run can exceed p items, and each level fits the worst case."""
    layout = piece_layout(c, p)
    longest, items = c, c
    for size in layout.sizes:
        assert size >= 1 and size <= 2 * items // (p + 1)
        longest, items = -(-longest // p), size
    assert min(longest, items) <= p
    assert len(layout.sizes) <= max(0, int(np.ceil(np.log(c) / np.log(p))) - 1) + 1


def test_layout_refuses_a_piece_that_cannot_shrink():
    with pytest.raises(ValueError, match="piece_len must be at least 2"):
        piece_layout(100, 1)
    assert piece_layout(100, None).sizes == ()


@pytest.mark.parametrize("dist", ["uniform", 0.8, 1.05, 1.2, 1.4])
def test_no_program_walks_more_than_a_piece(dist):
    """Every launch: serial chain <= one piece, work <= 2x the launch's mean + a piece per lane.

    A program walks its ``BLOCK`` runs (or pieces) in lock step, one item of
    each per step: its time is its chain, its work at most one piece per lane.
    """
    rng = np.random.default_rng(7)
    c, rows = 200_000, 1_000_000
    ids = _ids(dist if dist == "uniform" else max(dist, 1.01), c, rows, rng)
    if dist == 0.8:  # numpy's zipf needs a > 1: draw Zipf 0.8 by inverse CDF over the rows
        w = 1.0 / np.arange(1, rows + 1) ** 0.8
        ids = rng.permutation(rows)[np.searchsorted(np.cumsum(w) / w.sum(), rng.random(c))]
    valid = rng.random(c) > 0.05
    hottest = np.bincount(ids[valid]).max()
    layout, plan = _plan(ids, valid, PIECE, rows)
    loads = program_loads(plan, BLOCK)
    assert len(loads) == len(layout.sizes) + 1
    for load in loads:
        busy = load.items[load.items > 0]
        if busy.size == 0:
            continue
        assert load.chain.max() <= PIECE
        assert load.items.max() <= 2 * busy.mean() + BLOCK * PIECE
    # The unbalanced schedule: one program sums the hottest row alone.
    _, old = _plan(ids, valid, None, rows)
    (old_load,) = program_loads(old, BLOCK)
    assert old_load.chain.max() == hottest
    if dist != "uniform" and dist >= 1.05:
        assert hottest > 2 * old_load.items[old_load.items > 0].mean() + BLOCK * PIECE


@pytest.mark.parametrize("dist", ["uniform", 1.2, 2.5])
def test_plan_sums_each_run_exactly_once(dist):
    """Integer-valued gradients: every run's pieces add up to the row's exact total."""
    rng = np.random.default_rng(3)
    c, rows = 20_000, 5_000
    ids = _ids(dist, c, rows, rng)
    valid = rng.random(c) > 0.1
    layout, plan = _plan(ids, valid, 4, rows)
    assert len(layout.sizes) >= 3
    values = rng.integers(-50, 50, c).astype(np.float64)
    got = _execute(plan, layout, values)
    want = np.zeros(rows)
    np.add.at(want, ids[valid], values[valid])
    touched = np.unique(ids[valid])
    assert sorted(got) == touched.tolist()
    np.testing.assert_array_equal([got[r] for r in touched], want[touched])


OPTIMIZERS = {
    "sgd": ({}, optim.sgd),
    "adagrad": ({"eps": 1e-6}, optim.adagrad),
    "rowwise_adagrad": ({"weight_decay": 0.01, "weight_decay_mode": "L2"}, optim.rowwise_adagrad),
    "adam": ({"weight_decay": 0.01}, optim.adam),
    "partial_rowwise_adam": ({}, optim.partial_rowwise_adam),
    "lamb": ({"weight_decay": 0.01}, optim.lamb),
    "partial_rowwise_lamb": ({}, optim.partial_rowwise_lamb),
    "lars_sgd": ({"weight_decay": 0.01}, optim.lars_sgd),
}


def _skewed_batch(seed, c=120, rows=30, segments=16, dim=8):
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.3, c) - 1, rows - 1)
    ids[:70] = 5  # one hot row: 70 occurrences, two reduction levels at piece_len 4
    ids = rng.permutation(ids).astype(np.int32)
    seg = rng.integers(0, segments, c).astype(np.int32)
    scale = rng.random(c).astype(np.float32)
    valid = rng.random(c) > 0.1
    table = rng.normal(size=(rows, dim)).astype(np.float32)
    grad = rng.normal(size=(segments, dim)).astype(np.float32)
    return ids, seg, scale, valid, table, grad


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_balanced_update_matches_float64_numpy(name):
    """Interpreted kernel, two steps, every optimizer, against float64 sums and FBGEMM's maths."""
    hp, make = OPTIMIZERS[name]
    lr = 0.05
    opt = make(lr, **hp)
    ids, seg, scale, valid, table, grad = _skewed_batch(0)
    rows, dim = table.shape
    state = opt.init(rows, dim)
    got = (jnp.asarray(table), state)
    want_t, want_s = table.astype(np.float64), ref.init_state(name, rows, dim)
    counts = np.bincount(ids[valid], minlength=rows)
    for t in (1, 2):
        g = grad * t
        got = fused_backward_update(
            opt, *got, jnp.asarray(g), seg, scale, ids, valid, piece_len=4, interpret=True
        )
        summed = np.zeros((rows, dim))
        np.add.at(summed, ids[valid], g[seg[valid]].astype(np.float64) * scale[valid, None])
        touched = np.flatnonzero(counts)
        want_t, want_s = ref.apply_rows(name, want_t, want_s, touched, summed[touched], t, lr, **hp)
        # float32 sums of up to 70 terms, then the update: error grows with the duplicates.
        tol = 1e-5 * (1 + counts.max() / 8)
        np.testing.assert_allclose(np.asarray(got[0]), want_t, rtol=tol, atol=tol)
        for f, want in want_s.items():
            np.testing.assert_allclose(np.asarray(getattr(got[1], f)), want, rtol=tol, atol=tol)
    untouched = counts == 0
    np.testing.assert_array_equal(np.asarray(got[0])[untouched], table[untouched])
