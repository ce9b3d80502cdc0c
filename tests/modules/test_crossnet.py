"""Cross networks: TorchRec parity (same weights, same outputs), init, gradients, jit."""

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
    numpy_weights,
    randomize,
    run_torch,
)

import jaxrec.modules as jm

N = 6
X = np.random.default_rng(0).normal(size=(4, N)).astype(np.float32)

CASES = {
    "CrossNet": (dict(in_features=N, num_layers=2), {}),
    "LowRankCrossNet": (dict(in_features=N, num_layers=3, low_rank=2), {}),
    "VectorCrossNet": (dict(in_features=N, num_layers=2), {}),
    "LowRankMixtureCrossNet": (
        dict(in_features=N, num_layers=2, num_experts=3, low_rank=2),
        {},
    ),
    "LowRankMixtureCrossNet-1expert": (dict(in_features=N, num_layers=2, low_rank=3), {}),
}


def build(name, **kw):
    cls = name.split("-")[0]
    args, _ = CASES[name]
    return getattr(jm, cls)(**args, **kw)


@pytest.mark.parametrize("name", list(CASES))
def test_crossnet_matches_torchrec(name):
    torch, _ = needs_torchrec()
    from torchrec.modules import crossnet

    args, _ = CASES[name]
    theirs = randomize(getattr(crossnet, name.split("-")[0])(**args), scale=0.3)
    ours = nnx.eval_shape(lambda: build(name, rngs=nnx.Rngs(0)))  # weights from TorchRec
    assert sorted(jm.torchrec_keys(ours)) == sorted(theirs.state_dict())
    jm.load_torchrec_state_dict(ours, theirs.state_dict())
    assert_close(jit_call(ours, X), run_torch(theirs, torch.from_numpy(X)))


def test_mixture_crossnet_activation_by_name_and_callable():
    torch, _ = needs_torchrec()
    from torchrec.modules.crossnet import LowRankMixtureCrossNet

    theirs = randomize(
        LowRankMixtureCrossNet(N, 1, num_experts=2, low_rank=2, activation=torch.tanh)
    )
    for act in (jnp.tanh, nnx.Sequential(jnp.tanh)):
        ours = nnx.eval_shape(
            lambda act=act: jm.LowRankMixtureCrossNet(
                N, 1, num_experts=2, low_rank=2, activation=act, rngs=nnx.Rngs(0)
            )
        )
        jm.load_torchrec_state_dict(ours, theirs.state_dict())
        assert_close(jit_call(ours, X), run_torch(theirs, torch.from_numpy(X)))
    sig = jm.LowRankMixtureCrossNet(N, 1, activation="sigmoid", rngs=nnx.Rngs(0))
    assert sig(X).shape == X.shape


def test_crossnet_init_like_torchrec():
    net = jm.LowRankMixtureCrossNet(8, 1, num_experts=2, low_rank=4, rngs=nnx.Rngs(0))
    assert not np.any(net.bias[0].get_value())  # biases start at zero
    u = np.asarray(net.U_kernels[0].get_value())  # [K, N, r]: torch fans (N*r, K*r)
    assert u.shape == (2, 8, 4)
    assert 0.5 < u.std() / np.sqrt(2 / (8 * 4 + 2 * 4)) < 1.5
    full = jm.CrossNet(8, 1, rngs=nnx.Rngs(0))
    assert 0.7 < np.asarray(full.kernels[0].get_value()).std() / np.sqrt(2 / 16) < 1.3


def test_crossnet_grads_finite_and_jit_traces_once():
    net = numpy_weights(lambda: build("LowRankMixtureCrossNet", rngs=nnx.Rngs(0)))
    traces = []

    @nnx.jit
    def loss_and_grad(m, x):
        traces.append(1)
        return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(m)

    loss, grads = loss_and_grad(net, X)
    loss_and_grad(net, X * 2)
    assert len(traces) == 1 and np.isfinite(loss)
    assert_finite_tree(nnx.state(grads))
    assert any(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(nnx.state(grads)))


def test_crossnet_checks_arguments_and_input_width():
    with pytest.raises(ValueError, match="low_rank must be an int >= 1"):
        jm.LowRankCrossNet(N, 2, low_rank=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_experts"):
        jm.LowRankMixtureCrossNet(N, 2, num_experts=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"expects input \[batch_size, 6\]"):
        jm.CrossNet(N, 1, rngs=nnx.Rngs(0))(np.ones((2, 5), np.float32))
