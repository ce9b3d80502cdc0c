"""Perceptron, MLP and SwishLayerNorm: TorchRec parity, dtypes, gradients, jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from torchrec_helpers import (
    assert_close,
    assert_finite_tree,
    jit_call,
    needs_torchrec,
    randomize,
    run_torch,
    to_torch,
)

import jaxrec.modules as jm

X = np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32)


def torch_activation(name):
    torch, _ = needs_torchrec()
    return {"relu": torch.relu, "sigmoid": torch.sigmoid}[name]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["relu", "sigmoid"])
def test_perceptron_matches_torchrec(bias, activation):
    _, torchrec = needs_torchrec()
    from torchrec.modules.mlp import Perceptron

    theirs = randomize(Perceptron(6, 4, bias=bias, activation=torch_activation(activation)))
    ours = nnx.eval_shape(
        lambda: jm.Perceptron(6, 4, bias=bias, activation=activation, rngs=nnx.Rngs(0))
    )  # abstract: every parameter comes from TorchRec
    jm.load_torchrec_state_dict(ours, theirs.state_dict())
    assert_close(jit_call(ours, X), run_torch(theirs, to_torch(X)))


@pytest.mark.parametrize(
    "activation,on_last",
    [("relu", True), ("sigmoid", False), ("swish_layernorm", True), ("swish_layernorm", False)],
)
def test_mlp_matches_torchrec(activation, on_last):
    needs_torchrec()
    from torchrec.modules.mlp import MLP

    kw = dict(bias=True, activation=activation, activation_on_last=on_last)
    theirs = randomize(MLP(6, [8, 4, 3], **kw))
    ours = nnx.eval_shape(lambda: jm.MLP(6, [8, 4, 3], **kw, rngs=nnx.Rngs(0)))
    assert sorted(jm.torchrec_keys(ours)) == sorted(theirs.state_dict())
    jm.load_torchrec_state_dict(ours, theirs.state_dict())
    assert_close(jit_call(ours, X), run_torch(theirs, to_torch(X)))


def test_mlp_activation_factory_gives_each_layer_its_own_module():
    needs_torchrec()
    from torchrec.modules.activation import SwishLayerNorm
    from torchrec.modules.mlp import MLP

    theirs = randomize(MLP(6, [8, 8], activation=lambda: SwishLayerNorm(8)))
    ours = nnx.eval_shape(
        lambda: jm.MLP(6, [8, 8], activation=lambda: jm.SwishLayerNorm(8), rngs=nnx.Rngs(0))
    )
    jm.load_torchrec_state_dict(ours, theirs.state_dict())  # one LayerNorm per layer
    assert_close(jit_call(ours, X), run_torch(theirs, to_torch(X)))


def test_swish_layernorm_over_trailing_dims_matches_torchrec():
    needs_torchrec()
    from torchrec.modules.activation import SwishLayerNorm

    x = np.random.default_rng(1).normal(size=(2, 3, 4, 5)).astype(np.float32)
    theirs = randomize(SwishLayerNorm([4, 5]))
    ours = jm.SwishLayerNorm([4, 5])
    jm.load_torchrec_state_dict(ours, theirs.state_dict())  # norm.0.weight: [4, 5]
    assert_close(jit_call(ours, x), run_torch(theirs, to_torch(x)))


def test_mlp_shapes_dtypes_grads_and_jit():
    half = nnx.eval_shape(
        lambda: jm.MLP(6, [8, 2], param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    )
    assert half._mlp.layers[0]._linear.kernel.get_value().dtype == jnp.bfloat16
    assert nnx.eval_shape(lambda m: m(X), half).dtype == jnp.bfloat16  # shapes only, no compile

    mlp = jm.MLP(6, [8, 2], activation=jax.nn.gelu, rngs=nnx.Rngs(0))
    traces = []

    @nnx.jit
    def loss_and_grad(m, x):
        traces.append(1)
        return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(m), m(x)

    (loss, grads), out = loss_and_grad(mlp, X)
    loss_and_grad(mlp, X + 1)
    assert len(traces) == 1 and out.shape == (5, 2) and out.dtype == jnp.float32
    assert np.isfinite(loss)
    assert_finite_tree(nnx.state(grads))


def test_mlp_rejects_unknown_activation_names_and_bad_factories():
    with pytest.raises(ValueError, match="not one of TorchRec's names"):
        jm.MLP(6, [4], activation="tanh", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="must return an nnx.Module"):
        jm.MLP(6, [4], activation=lambda: 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="at least one layer"):
        jm.MLP(6, [], rngs=nnx.Rngs(0))


def test_torch_like_initialisation_bounds():
    p = jm.Perceptron(100, 50, rngs=nnx.Rngs(0))
    w, b = p._linear.kernel.get_value(), p._linear.bias.get_value()
    assert float(jnp.abs(w).max()) <= 0.1 and float(jnp.abs(b).max()) <= 0.1  # 1/sqrt(100)
    assert float(jnp.abs(w).max()) > 0.09 and float(jnp.std(b)) > 0.03
