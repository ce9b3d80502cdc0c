"""Every sparse optimizer through the train step, against the numpy reference.

The reference takes exact row gradients from dense autodiff of the same loss
(through the stacked tables) and applies the published FBGEMM formulas to the
rows the batch touched.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_optimizers as ref
import optax
import pytest
from flax import nnx
from train_models import BagModel, mse, random_batch

import jaxrec as jr
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

CASES = {
    "sgd": ({"learning_rate": 0.1}, {}),
    "adagrad": ({"learning_rate": 0.1, "eps": 1e-6}, {"eps": 1e-6}),
    "rowwise_adagrad": (
        {"learning_rate": 0.1, "weight_decay": 0.01, "weight_decay_mode": "L2"},
        {"weight_decay": 0.01, "weight_decay_mode": "L2"},
    ),
    "adam": ({"learning_rate": 0.05, "weight_decay": 0.01}, {"weight_decay": 0.01}),
    "partial_rowwise_adam": ({"learning_rate": 0.05}, {}),
    "lamb": ({"learning_rate": 0.05, "weight_decay": 0.01}, {"weight_decay": 0.01}),
    "partial_rowwise_lamb": ({"learning_rate": 0.05}, {}),
    "lars_sgd": ({"learning_rate": 0.5, "weight_decay": 0.01}, {"weight_decay": 0.01}),
}
# Rows each feature touches in each stacked group: (group, key, row offset).
READS = [
    ("fp32_d4", "a", 0),
    ("fp32_d4", "b", 0),
    ("fp32_d4", "d", 30),
    ("fp32_d4", "b", 30),
    ("fp32_d8", "c", 0),
]


def touched(kjt, group):
    rows = set()
    for g, key, off in READS:
        if g == group:
            jt = kjt[key]
            rows |= {off + int(i) for i in np.asarray(jt.values())[: int(jt.lengths().sum())]}
    return np.asarray(sorted(rows))


@pytest.mark.parametrize("name", list(CASES))
def test_optimizer_steps_match_numpy_reference(name):
    kwargs, ref_kwargs = CASES[name]
    lr = kwargs["learning_rate"]
    rng = np.random.default_rng(7)
    model = BagModel(weighted=True, rngs=nnx.Rngs(0))
    opt = CombinedOptimizer(optax.sgd(0.0), getattr(optim, name)(**kwargs))
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, mse)
    tables = {
        g: np.array(state.tables["sparse"]["ebc"]["weights"][g].get_value())
        for g in ("fp32_d4", "fp32_d8")
    }
    states = {g: ref.init_state(name, t.shape[0], t.shape[1]) for g, t in tables.items()}
    grad_fn = jax.jit(nnx.grad(mse, argnums=nnx.DiffState(0, jr.EmbeddingTable)))
    for t in range(1, 4):
        batch = random_batch(rng, weighted=True)
        model_now = train.merge_model(graphdef, jax.tree.map(jnp.copy, state))
        grads = grad_fn(model_now, batch)["sparse"]["ebc"]["weights"]
        state, _, _ = step(state, batch)
        for g in tables:
            rows = touched(batch[0], g)
            dense = np.asarray(grads[g].get_value())
            tables[g], states[g] = ref.apply_rows(
                name, tables[g], states[g], rows, dense[rows], t, lr, **ref_kwargs
            )
            got = np.asarray(state.tables["sparse"]["ebc"]["weights"][g].get_value())
            np.testing.assert_allclose(
                got, tables[g], rtol=2e-5, atol=2e-6, err_msg=f"{g} step {t}"
            )
