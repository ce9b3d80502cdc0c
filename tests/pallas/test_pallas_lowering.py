"""Every kernel lowers for CUDA on this machine (no GPU needed): GPU compile errors surface in CI.

``lower(lowering_platforms=("cuda",))`` runs the Pallas -> Triton lowering and
embeds the Triton IR in a ``__gpu$xla.gpu.triton`` custom call; PTX is only
produced when XLA compiles on a GPU (the compiled tests in test_pallas_gpu.py).
The Mosaic GPU kernel lowers the same way into a ``mosaic_gpu_v2`` custom call
(Pallas -> Mosaic GPU MLIR, with Mosaic's layout, copy and shared-memory checks);
its PTX is produced only when the program is loaded on a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxrec import optim
from jaxrec.pallas import (
    Tiling,
    fused_backward_update,
    pooled_lookup,
    sequence_lookup,
    sparse_update,
)
from jaxrec.pallas.mosaic_pooled import MosaicTiling, pooled_lookup_mosaic

R, D, C, S = 64, 20, 48, 12  # D a multiple of 4, not a power of two


def _lower(fn, *args):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text
    return text


def _ints(n, hi):
    return jnp.arange(n, dtype=jnp.int32) % hi


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("with_segments,mean", [(False, False), (True, True)])
def test_pooled_lookup_lowers(dtype, with_segments, mean):
    w = jnp.zeros((R, D), dtype)
    seg = _ints(C, S) if with_segments else None
    fn = functools.partial(pooled_lookup, mean=mean, tiling=Tiling(block_rows=16, num_warps=2))
    _lower(fn, w, _ints(C, R), _ints(S, C), _ints(S, C) + 2, jnp.ones((C,)), seg)


@pytest.mark.parametrize(
    "dtype,dim,with_segments,mean,tiling",
    [
        (jnp.float32, 64, True, False, MosaicTiling()),
        (jnp.bfloat16, 128, False, True, MosaicTiling(block_bags=16, num_stages=1)),
        (jnp.float16, 128, True, True, MosaicTiling(block_cols=64, manual_barriers=True)),
    ],
)
def test_pooled_lookup_mosaic_lowers(dtype, dim, with_segments, mean, tiling):
    w = jnp.zeros((R, dim), dtype)
    seg = _ints(C, S) if with_segments else None
    fn = functools.partial(pooled_lookup_mosaic, mean=mean, tiling=tiling)
    args = (w, _ints(C, R), _ints(S, C), _ints(S, C) + 2, jnp.ones((C,)), seg)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu_v2" in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sequence_lookup_lowers(dtype):
    _lower(sequence_lookup, jnp.zeros((R, D), dtype), _ints(C, R), jnp.ones((C,), bool))


OPTS = {
    "sgd": optim.sgd(0.1),
    "rowwise_adagrad": optim.rowwise_adagrad(0.1),
    "adam": optim.adam(0.01),
    "partial_rowwise_adam": optim.partial_rowwise_adam(0.01),
    "adagrad": optim.adagrad(0.1),
    "lamb": optim.lamb(0.01),
    "lars_sgd": optim.lars_sgd(0.1),
}


@pytest.mark.parametrize("name", sorted(OPTS))
def test_fused_backward_update_lowers(name):
    opt = OPTS[name]
    fn = functools.partial(fused_backward_update, opt)
    table, state = jnp.zeros((R, D), jnp.bfloat16), opt.init(R, D)
    valid = jnp.ones((C,), bool)
    _lower(fn, table, state, jnp.zeros((S, D)), _ints(C, S), jnp.ones((C,)), _ints(C, R), valid)


def test_sparse_update_lowers_and_aliases():
    opt = OPTS["rowwise_adagrad"]
    fn = functools.partial(sparse_update, opt)
    table, state = jnp.zeros((R, D)), opt.init(R, D)
    text = _lower(fn, table, state, _ints(C, R), jnp.zeros((C, D)))
    assert "output_operand_aliases" in text  # table and state updated in place
