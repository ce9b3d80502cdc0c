"""Models, plans and batches for the checkpoint tests (on top of the sharding tests' cases).

One global batch of ``N`` samples is split over 8 devices (row-wise), 4 devices
(table-wise) or given whole (unsharded), so every run trains on the same data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from sharding_cases import KEYS, PLANS, ROWS, Model, _kjt, mesh_2d
from sharding_cases import loss_fn as loss_fn
from sharding_cases import mesh_1d as mesh_1d
from sharding_cases import tables as tables

import jaxrec as jr
from jaxrec import checkpoint as ckpt
from jaxrec import distributed as d
from jaxrec import train

N = 32  # samples per global batch
MAX_LEN = 3  # ids per bag

TABLE_WISE_4 = {
    "t1": d.table_wise(0),
    "t2": d.table_wise(3),
    "t3": d.table_wise(1),
    "t4": d.table_wise(2),
}
LAYOUTS = {  # name: (plan generators, devices); None: unsharded on one device
    "row_wise_8": (PLANS["row_wise"][0], 8),
    "table_wise_4": (TABLE_WISE_4, 4),
    "unsharded": (None, 1),
}


def mesh_of(devices: int) -> jax.sharding.Mesh:
    if devices == 8:
        return mesh_1d()
    return jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("x",))


def build(layout: str, optimizer, plan=None):
    """``(graphdef, state, mesh)`` of the shared test model laid out as ``layout``."""
    gens, devices = LAYOUTS[layout] if plan is None else (plan, 8)
    model = Model(rngs=nnx.Rngs(1))
    mesh = None
    if gens is not None:
        mesh = mesh_of(devices)
        plan = d.construct_module_sharding_plan(model.ebc, gens, world_size=devices)
        model = d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh)
    graphdef, state = train.init_train_state(model, optimizer)
    return graphdef, state, mesh


def build_plan(name: str, optimizer):
    """``(graphdef, state)`` of the shared model under ``sharding_cases.PLANS[name]``."""
    gens, hosts = PLANS[name]
    mesh = mesh_1d() if hosts == 1 else mesh_2d()
    model = Model(rngs=nnx.Rngs(1))
    plan = d.construct_module_sharding_plan(model.ebc, gens, world_size=8, local_size=8 // hosts)
    model = d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh)
    return train.init_train_state(model, optimizer)


class TablesModel(nnx.Module):
    """``Model`` with other tables (for mismatch tests), optionally with a dropout rng."""

    def __init__(self, configs, *, rngs, dropout=False):
        self.ebc = jr.EmbeddingBagCollection(configs, rngs=nnx.Rngs(0))
        dims = sum(t.embedding_dim * len(t.feature_names) for t in configs)
        self.head = nnx.Linear(dims, 1, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs) if dropout else None


def samples(seed: int):
    """One global batch: ``{key: [bag ids] * N}`` and labels ``[N]``."""
    rng = np.random.default_rng(seed)
    bags = {
        k: [rng.integers(0, ROWS[k], int(rng.integers(0, MAX_LEN + 1))).tolist() for _ in range(N)]
        for k in KEYS
    }
    return bags, rng.normal(size=N).astype(np.float32)


def batch(sample, mesh):
    """The global batch for ``mesh`` (split over its devices) or unsharded (``None``)."""
    bags, y = sample
    if mesh is None:
        return _kjt(bags, None, {k: MAX_LEN * N for k in KEYS}), jnp.asarray(y)
    n = mesh.size
    b = N // n
    local = [
        (
            _kjt(
                {k: bags[k][i * b : (i + 1) * b] for k in KEYS},
                None,
                {k: MAX_LEN * b for k in KEYS},
            ),
            y[i * b : (i + 1) * b],
        )
        for i in range(n)
    ]
    return d.shard_batch(local, mesh)


def leaves(state) -> list[np.ndarray]:
    """Every array of a state as numpy (typed keys as their key data)."""
    out = []
    for x in jax.tree.leaves(state):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x))
    return out


def host(logical: ckpt.LogicalState) -> dict:
    """A logical state as flat ``{name: numpy array}`` (for comparisons)."""
    out = {}
    for part in ("params", "rest", "dense_opt"):
        for path, x in jax.tree_util.tree_flatten_with_path(getattr(logical, part))[0]:
            out[part + jax.tree_util.keystr(path)] = np.asarray(x)
    for key, entry in logical.tables.items():
        for f, x in entry.items():
            out[f"{key}.{f}"] = np.asarray(x)
    return out


def assert_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def assert_close(a: dict, b: dict, rtol=1e-5, atol=1e-6) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)
