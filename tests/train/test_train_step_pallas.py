"""The train step's fused backward + update through the Pallas kernel equals the XLA path."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from train_models import BagModel, SeqModel, mse, random_batch

from jaxrec import optim
from jaxrec.embedding import CombinedOptimizer
from jaxrec.train import init_train_state, make_train_step


def _seq_loss(model, batch):
    return model(batch[0])


@pytest.mark.parametrize(
    "make_model, loss_fn, sparse",
    [
        (lambda: BagModel(weighted=True, rngs=nnx.Rngs(0)), mse, optim.rowwise_adagrad(0.1)),
        (lambda: BagModel(rngs=nnx.Rngs(0)), mse, optim.adam(0.05)),
        (lambda: SeqModel(rngs=nnx.Rngs(0)), _seq_loss, optim.sgd(0.1)),  # two calls, one buffer
    ],
    ids=["bag-weighted-rowwise-adagrad", "bag-adam", "seq-twice-sgd"],
)
def test_train_step_pallas_equals_xla(make_model, loss_fn, sparse):
    rng = np.random.default_rng(0)
    batches = [random_batch(rng, weighted=True) for _ in range(2)]
    results = {}
    for impl in ("xla", "pallas"):
        opt = CombinedOptimizer(optax.sgd(0.01), sparse)
        graphdef, state = init_train_state(make_model(), opt)
        step = make_train_step(graphdef, opt, loss_fn, implementation=impl)
        if impl == "pallas":  # the fused kernel is really in the program
            assert "pallas_call" in str(jax.make_jaxpr(step.jitted)(state, batches[0]))
        for b in batches:
            state, loss, _ = step(state, b)
        results[impl] = (state, loss)
    got, want = results["pallas"], results["xla"]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
