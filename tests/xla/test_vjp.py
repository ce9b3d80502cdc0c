"""``with_xla_vjp``: the kernel's output forward, the XLA twin's derivative backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrec.xla.lookup import embedding_bag_xla
from jaxrec.xla.vjp import with_xla_vjp


def _bag_kernel(weights, rows, segment_ids, num_segments, scale):
    """A stand-in kernel: the XLA sums plus a marker, so the test sees which forward ran."""
    return embedding_bag_xla(weights, rows, segment_ids, num_segments, scale) + 1000.0


ROWS = jnp.array([0, 2, 2, 1, 3], jnp.int32)
SEG = jnp.array([0, 0, 1, 1, 5], jnp.int32)  # 5 >= num_segments: dropped


@pytest.mark.parametrize("jit", [False, True])
def test_forward_is_the_kernel_and_gradients_are_the_references(jit):
    weights = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
    scale = jnp.array([0.5, 1.0, 2.0, -1.0, 3.0], jnp.float32)
    bag = with_xla_vjp(_bag_kernel, embedding_bag_xla, nondiff_argnums=(3,))

    def loss(fn, w, s):
        return jnp.sum(fn(w, ROWS, SEG, 2, s) ** 2)

    grad = jax.grad(lambda w, s: loss(bag, w, s), argnums=(0, 1))
    grad = jax.jit(grad) if jit else grad
    np.testing.assert_allclose(
        bag(weights, ROWS, SEG, 2, scale), _bag_kernel(weights, ROWS, SEG, 2, scale)
    )
    # The gradient of the kernel's loss, through the reference's derivative: the
    # cotangent is the kernel's output (marker included), the vjp the reference's.
    out = _bag_kernel(weights, ROWS, SEG, 2, scale)
    _, vjp = jax.vjp(lambda w, s: embedding_bag_xla(w, ROWS, SEG, 2, s), weights, scale)
    want = vjp(2.0 * out)
    for got, expected in zip(grad(weights, scale), want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_integer_arguments_get_float0_cotangents():
    bag = with_xla_vjp(_bag_kernel, embedding_bag_xla, nondiff_argnums=(3,))
    weights, scale = jnp.ones((4, 3)), jnp.ones((5,))
    _, vjp = jax.vjp(lambda w, r, s, sc: bag(w, r, s, 2, sc), weights, ROWS, SEG, scale)
    dw, drows, dseg, dscale = vjp(jnp.ones((2, 3)))
    assert drows.dtype == jax.dtypes.float0 and dseg.dtype == jax.dtypes.float0
    assert dw.shape == weights.shape and dscale.shape == scale.shape


def test_aux_outputs_carry_no_gradient():
    """``has_aux``: the kernel's second output (a count) is returned, not differentiated."""

    def kernel(x, n):
        return x * n, jnp.sum(x > 0).astype(jnp.int32)

    fn = with_xla_vjp(kernel, lambda x, n: x * n, nondiff_argnums=(1,), has_aux=True)
    out, count = fn(jnp.array([1.0, -2.0, 3.0]), 4.0)
    np.testing.assert_array_equal(out, [4.0, -8.0, 12.0])
    assert int(count) == 2
    np.testing.assert_array_equal(
        jax.grad(lambda x: jnp.sum(fn(x, 4.0)[0]))(jnp.ones(3)), [4.0, 4.0, 4.0]
    )
