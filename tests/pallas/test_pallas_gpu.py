"""Compiled (non-interpreted) kernels on a GPU: the same checks as the interpret tests.

Skipped without a GPU backend; run on the GPU machine with
``python -m pytest tests/pallas``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import LENGTHS, on_gpu, pooled_tolerance, ragged_case

from jaxrec import optim
from jaxrec.ops import pooled_lookup as ops_pooled_lookup
from jaxrec.pallas import (
    fused_backward_update,
    fused_backward_update_reference,
    pooled_lookup,
    pooled_lookup_reference,
    sequence_lookup,
    sequence_lookup_reference,
)

pytestmark = pytest.mark.skipif(
    not on_gpu(), reason=f"needs a GPU backend (jax.default_backend() is {jax.default_backend()!r})"
)


@pytest.mark.parametrize("dim,dtype,mean", [(12, "fp32", False), (128, "bf16", True)])
def test_pooled_lookup_compiled(dim, dtype, mean):
    w, rows, starts, ends, scale, seg, lengths = ragged_case(
        0, dim=dim, dtype=dtype, weighted=True, padding=3
    )
    got = pooled_lookup(w, rows, starts, ends, scale, seg, mean=mean)
    want = pooled_lookup_reference(w, rows, starts, ends, scale, seg, mean=mean)
    np.testing.assert_allclose(got, want, atol=pooled_tolerance(w, scale, max(lengths)), rtol=0)


def test_sequence_lookup_compiled():
    w, rows, _, _, _, seg, _ = ragged_case(1, dim=20, dtype="fp16", weighted=False, padding=3)
    valid = seg < len(LENGTHS)
    np.testing.assert_array_equal(
        sequence_lookup(w, rows, valid), sequence_lookup_reference(w, rows, valid)
    )


@pytest.mark.parametrize(
    "opt", [optim.sgd(0.1), optim.rowwise_adagrad(0.1), optim.adam(0.01)], ids=lambda o: o.name
)
def test_fused_backward_update_compiled(opt):
    w, rows, _, _, scale, seg, _ = ragged_case(2, dim=20, dtype="fp32", weighted=True, padding=3)
    valid = seg < len(LENGTHS)
    out_grad = jax.random.normal(jax.random.key(0), (len(LENGTHS), 20))
    state = opt.init(w.shape[0], 20)
    got = fused_backward_update(opt, w, state, out_grad, seg, scale, rows, valid)
    want = fused_backward_update_reference(opt, w, state, out_grad, seg, scale, rows, valid)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_default_dispatch_uses_the_kernel_on_gpu():
    t = jnp.ones((10, 8))
    text = jax.jit(lambda t: ops_pooled_lookup(t, jnp.array([1, 2]), jnp.array([2]))).lower(t)
    assert "triton" in text.as_text()
