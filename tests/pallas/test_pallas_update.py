"""Fused backward + optimizer update kernels, interpreted, against their references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import DTYPES, ragged_case

from jaxrec import optim
from jaxrec.pallas import (
    fused_backward_update,
    fused_backward_update_reference,
    sparse_update,
    sparse_update_reference,
)
from jaxrec.xla.backward import dedup_rows

OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.1),
    "rowwise_adagrad": lambda: optim.rowwise_adagrad(
        0.1, weight_decay=0.01, weight_decay_mode="L2"
    ),
    "adam": lambda: optim.adam(0.01, weight_decay=0.01),
}


def _close(got, want, dtype):
    # Same float32 maths on both sides; a table in fp16/bf16 may round one ulp apart.
    tol = {"fp32": 1e-6, "fp16": 2.0**-10, "bf16": 2.0**-7}[dtype]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, atol=tol * (1 + np.abs(b).max()), rtol=0)


def _batch(dim, dtype, seed=0):
    w, rows, starts, ends, scale, seg, lengths = ragged_case(
        seed, dim=dim, dtype=dtype, weighted=True, padding=3
    )
    out_grad = jax.random.normal(jax.random.key(seed), (len(lengths), dim))
    valid = seg < len(lengths)
    return w, out_grad, seg, scale, rows, valid


@pytest.mark.parametrize(
    "name,dim,dtype",
    [("sgd", 12, "fp32"), ("rowwise_adagrad", 20, "bf16"), ("adam", 16, "fp16")],
)
def test_fused_backward_update_matches_reference_over_steps(name, dim, dtype):
    opt = OPTIMIZERS[name]()
    w, out_grad, seg, scale, rows, valid = _batch(dim, dtype)
    state = opt.init(w.shape[0], dim)
    got, want = (w, state), (w, state)
    for step in range(2):  # the second step reads state written by the first
        g = out_grad * (step + 1)
        got = fused_backward_update(opt, *got, g, seg, scale, rows, valid, interpret=True)
        want = fused_backward_update_reference(opt, *want, g, seg, scale, rows, valid)
        _close(got, want, dtype)
    assert got[0].dtype == DTYPES[dtype] and int(got[1].count) == 2
    touched = np.unique(np.asarray(rows)[np.asarray(valid)])
    untouched = np.setdiff1d(np.arange(w.shape[0]), touched)
    np.testing.assert_array_equal(np.asarray(got[0])[untouched], np.asarray(w)[untouched])


def test_duplicates_are_summed_before_the_update():
    """Row-wise Adagrad is nonlinear in g: two half-updates differ from one summed update."""
    opt = OPTIMIZERS["rowwise_adagrad"]()
    w = jnp.ones((8, 4), jnp.float32)
    state = opt.init(8, 4)
    g = jnp.asarray([[1.0, 2.0, 3.0, 4.0]])
    rows = jnp.asarray([5, 5, 5, 2], jnp.int32)  # row 5 three times, all from output row 0
    seg = jnp.zeros((4,), jnp.int32)
    ones, valid = jnp.ones((4,), jnp.float32), jnp.asarray([True, True, True, False])
    got = fused_backward_update(opt, w, state, g, seg, ones, rows, valid, interpret=True)
    want = optim.apply_rows(opt, w, state, jnp.asarray([5]), 3 * g)
    _close(got, want, "fp32")
    assert float(got[1].momentum1[2]) == 0.0  # the invalid occurrence touched nothing


def test_sparse_update_on_deduped_rows_and_state_rows():
    opt = OPTIMIZERS["adam"]()
    w, out_grad, seg, scale, rows, valid = _batch(12, "fp32", seed=1)
    grads = jnp.take(out_grad, jnp.where(valid, seg, 0), axis=0) * scale[:, None]
    unique, summed = dedup_rows(rows, grads, valid, w.shape[0])
    state = opt.init(w.shape[0], 12)
    got = sparse_update(opt, w, state, unique, summed, interpret=True)
    _close(got, sparse_update_reference(opt, w, state, unique, summed), "fp32")
    # State rows shifted by one (an optimizer owning part of a stacked buffer).
    big = opt.init(w.shape[0] + 1, 12)
    srows = jnp.where(unique < w.shape[0], unique + 1, w.shape[0] + 1)
    t2, s2 = sparse_update(opt, w, big, unique, summed, srows, interpret=True)
    np.testing.assert_allclose(t2, got[0], rtol=1e-6)
    np.testing.assert_allclose(s2.momentum1[1:], got[1].momentum1, rtol=1e-6)


def test_update_validation():
    opt = optim.sgd(0.1)
    w, state = jnp.zeros((4, 8)), opt.init(4, 8)
    rows = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="grads must be"):
        sparse_update(opt, w, state, rows, jnp.zeros((2, 4)), interpret=True)
    with pytest.raises(TypeError, match="SparseOptimizer"):
        sparse_update("sgd", w, state, rows, jnp.zeros((2, 8)), interpret=True)
    custom = opt._replace(update=lambda w, g, s, c: (w - g, s))  # no dim= keyword
    with pytest.raises(NotImplementedError, match="dim= keyword"):
        sparse_update(custom, jnp.zeros((4, 12)), state, rows, jnp.zeros((2, 12)), interpret=True)
