"""DeepFM and FactorizationMachine modules: TorchRec parity, shapes, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from torchrec_helpers import assert_close, jit_call, needs_torchrec, randomize, run_torch, to_torch

import jaxrec.modules as jm
from jaxrec.modules.initializers import torch_linear

rng = np.random.default_rng(0)
EMBEDDINGS = [
    rng.normal(size=(3, 2, 4)).astype(np.float32),
    rng.normal(size=(3, 1, 5)).astype(np.float32),
    rng.normal(size=(3, 6)).astype(np.float32),  # a [B, D] dense feature
]
WIDTH = 2 * 4 + 5 + 6


def test_factorization_machine_matches_torchrec():
    needs_torchrec()
    from torchrec.modules.deepfm import FactorizationMachine

    ours = jm.FactorizationMachine()(EMBEDDINGS)
    theirs = run_torch(FactorizationMachine(), [to_torch(e) for e in EMBEDDINGS])
    assert ours.shape == (3, 1)
    assert_close(ours, theirs)


def test_deepfm_matches_torchrec():
    torch, _ = needs_torchrec()
    from torchrec.modules.deepfm import DeepFM

    theirs = randomize(DeepFM(torch.nn.Sequential(torch.nn.Linear(WIDTH, 5), torch.nn.ReLU())))
    ours = nnx.eval_shape(
        lambda: jm.DeepFM(nnx.Sequential(torch_linear(WIDTH, 5, rngs=nnx.Rngs(0)), jax.nn.relu))
    )
    assert sorted(jm.torchrec_keys(ours)) == sorted(theirs.state_dict())  # dense_module.0.*
    jm.load_torchrec_state_dict(ours, theirs.state_dict())
    assert_close(jit_call(ours, EMBEDDINGS), run_torch(theirs, [to_torch(e) for e in EMBEDDINGS]))


def test_fm_formula_gradient_and_errors():
    x = [jnp.asarray(e) for e in EMBEDDINGS]
    flat = np.concatenate([e.reshape(3, -1) for e in EMBEDDINGS], axis=1).astype(np.float64)
    pairwise = sum(flat[:, i] * flat[:, j] for i in range(WIDTH) for j in range(i + 1, WIDTH))
    np.testing.assert_allclose(jm.FactorizationMachine()(x)[:, 0], pairwise, rtol=1e-4)
    g = jax.grad(lambda e: jm.FactorizationMachine()(e).sum())(x)  # d/dx_i = sum(x) - x_i
    np.testing.assert_allclose(g[2], flat.sum(1, keepdims=True) - flat[:, -6:], rtol=1e-5)
    with pytest.raises(ValueError, match="same batch size"):
        jm.FactorizationMachine()([jnp.ones((2, 3)), jnp.ones((3, 3))])
    with pytest.raises(TypeError, match="dense_module must be callable"):
        jm.DeepFM(3)
