"""The ragged id exchange on real GPUs: the same training as the padded one.

XLA:CPU has no ragged-all-to-all, so this runs only on a GPU machine (``bench/gpu_check.sh``
runs it); ``tests/gpu_compile/test_gpu_compile_train_step.py`` compiles it for H100s everywhere.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from sharding_cases import Model, batches, loss_fn

from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

gpus = [x for x in jax.devices() if x.platform == "gpu"]
pytestmark = pytest.mark.skipif(not gpus, reason="needs a GPU (XLA:CPU has no ragged-all-to-all)")


@pytest.mark.parametrize("capacity", [None, 1], ids=["fast_path", "overflow"])
def test_ragged_exchange_trains_like_padded(capacity):
    n = len(gpus)
    mesh = jax.make_mesh((n,), ("x",), devices=gpus, axis_types=(jax.sharding.AxisType.Auto,))
    opt = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.1))
    data = [batches(np.random.default_rng(i), world=n, weighted=True)[0] for i in range(2)]
    results = {}
    for exchange in ("padded", "ragged"):
        model = Model(True, rngs=nnx.Rngs(1))
        gens = {"t1": d.row_wise(), "t2": d.row_wise(), "t3": d.table_wise(0), "t4": d.row_wise()}
        plan = d.construct_module_sharding_plan(model.ebc, gens, world_size=n)
        model = d.DistributedModelParallel(
            model, d.ShardingPlan({"ebc": plan}), mesh, capacity=capacity, exchange=exchange
        )
        graphdef, state = train.init_train_state(model, opt)
        step = train.make_train_step(graphdef, opt, loss_fn)
        losses = []
        for local in data:
            state, loss, _ = step(state, d.shard_batch(local, mesh))
            losses.append(float(loss))
        tables = train.merge_model(graphdef, state).ebc.state_dict()
        results[exchange] = losses, {k: np.asarray(v) for k, v in tables.items()}
    np.testing.assert_allclose(results["ragged"][0], results["padded"][0], rtol=1e-6)
    for k, v in results["padded"][1].items():
        np.testing.assert_allclose(results["ragged"][1][k], v, rtol=1e-6, atol=1e-7, err_msg=k)
