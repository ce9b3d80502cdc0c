"""A sharded model and its train state built under tracing: shapes without allocation.

``jax.eval_shape`` of ``DistributedModelParallel`` + ``init_train_state`` is how
a model too big for this machine is compiled ahead of time (for GPUs that are
not there, see ``tests/gpu_compile``); under ``jax.jit`` the same construction
must place the same values.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from sharding_cases import PLANS, Model, mesh_1d, mesh_2d

from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer


def _build(name):
    gens, hosts = PLANS[name]
    mesh = mesh_1d() if hosts == 1 else mesh_2d()
    model = Model(rngs=nnx.Rngs(1))
    plan = d.construct_module_sharding_plan(model.ebc, gens, world_size=8, local_size=8 // hosts)
    model = d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh)
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    return train.init_train_state(model, opt)[1]


@pytest.mark.parametrize("name", ["grid_shard"])
def test_eval_shape_builds_the_concrete_shapes(name):
    concrete = _build(name)
    abstract = jax.eval_shape(lambda: _build(name))
    shapes = lambda t: [(x.shape, x.dtype) for x in jax.tree.leaves(t)]
    assert shapes(abstract) == shapes(concrete)


def test_jit_places_the_concrete_values():
    concrete = _build("mixed")
    traced = jax.jit(lambda: _build("mixed"))()
    for a, b in zip(jax.tree.leaves(traced), jax.tree.leaves(concrete), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
