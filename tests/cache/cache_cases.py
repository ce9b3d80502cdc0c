"""A model with two cached tables and one in device memory, and Zipf-like batches.

``big`` (shared by two features) and ``mean`` (MEAN pooling) are cached; ``small``
is not. Tables have different dims, so each is its own group buffer and the
all-device-memory model's buffers can be copied into the cached model's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxrec as jr
from jaxrec import cache as jc
from jaxrec import checkpoint as ckpt
from jaxrec import distributed as d
from jaxrec import train
from jaxrec.embedding import CombinedOptimizer

KEYS = ["a", "b", "m", "s"]
ROWS = {"big": 200, "mean": 120, "small": 30}
FEATURE_ROWS = {"a": 200, "b": 200, "m": 120, "s": 30}
CACHED = ("big", "mean")
B, MAX_LEN = 8, 3  # samples per batch (per device when sharded), ids per bag


def configs():
    return [
        jr.EmbeddingBagConfig(
            name="big", embedding_dim=8, num_embeddings=200, feature_names=["a", "b"]
        ),
        jr.EmbeddingBagConfig(
            name="mean",
            embedding_dim=6,
            num_embeddings=120,
            feature_names=["m"],
            pooling=jr.PoolingType.MEAN,
        ),
        jr.EmbeddingBagConfig(
            name="small", embedding_dim=4, num_embeddings=30, feature_names=["s"]
        ),
    ]


class Model(nnx.Module):
    def __init__(self, tables, *, rngs):
        self.ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(8 * 2 + 6 + 4, 1, rngs=rngs)

    def __call__(self, kjt):
        return jnp.tanh(self.head(self.ebc(kjt).values())[:, 0])


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def optimizer(sparse):
    return CombinedOptimizer(optax.sgd(0.05), sparse)


def local_batch(rng, n=B):
    """``(kjt, labels)`` of ``n`` samples: Zipf-like ids (some hot rows, a long tail)."""
    lengths, values = [], []
    for k in KEYS:
        for _ in range(n):
            m = int(rng.integers(0, MAX_LEN + 1))
            ids = np.minimum(rng.zipf(1.3, m) - 1, FEATURE_ROWS[k] - 1)
            lengths.append(m)
            values.extend(rng.permutation(FEATURE_ROWS[k])[ids].tolist() if m else [])
    kjt = jr.KeyedJaggedTensor.from_lengths_sync(
        KEYS, values, lengths, capacities={k: MAX_LEN * n for k in KEYS}
    )
    return kjt, rng.normal(size=n).astype(np.float32)


def build(opt, tables=None, plan=None, mesh=None):
    """``(graphdef, state)`` of the model (``plan``: the collection's plan, over ``mesh``)."""
    model = Model(tables or configs(), rngs=nnx.Rngs(1))
    if plan is not None:
        model = d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh)
    return train.init_train_state(model, opt)


def logical_plan(gens, mesh, params):
    """The plan of ``gens`` (generators per table) with the tables in ``params`` cached."""
    plan = d.construct_module_sharding_plan(
        Model(configs(), rngs=nnx.Rngs(1)).ebc, gens, world_size=mesh.size
    )
    for name, p in params.items():
        plan[name] = dataclasses.replace(
            plan[name], compute_kernel=d.EmbeddingComputeKernel.FUSED_UVM_CACHING, cache_params=p
        )
    return plan


def fused(plan):
    """``plan`` with every table in device memory (the all-device reference)."""
    return d.EmbeddingModuleShardingPlan(
        {
            k: dataclasses.replace(
                p, compute_kernel=d.EmbeddingComputeKernel.FUSED, cache_params=None
            )
            for k, p in plan.items()
        }
    )


def cached_twin(
    opt, graphdef, state, params, plan=None, mesh=None, slot_maps="device", move_paths=None
):
    """The cached model holding the same values as the all-device ``state``:
    ``(graphdef, state, RowCache)``; ``plan``: the logical plan with cached tables;
    ``slot_maps``: the device's by default (on a CPU, RowCache's default is the host's:
    the tests run the device maps unless they ask for the host's); ``move_paths``:
    ``RowCache``'s."""
    if plan is None:
        device_configs, device_plan = jc.cached_configs(configs(), params), None
    else:
        device_configs, device_plan = jc.device_plan(configs(), plan)
    g2, s2 = build(opt, device_configs, device_plan, mesh)
    logical = ckpt.logical_state(graphdef, opt, state)
    hosts = {}
    for c in configs():
        if c.name in CACHED:
            e = logical.tables[f"ebc.embedding_bags.{c.name}"]
            state_rows = {f: x for f, x in e.items() if f not in ("weight", "count")}
            hosts[c.name] = jc.HostTable.from_arrays(
                c, opt.for_table(c.name), e["weight"], state_rows
            )
    logical = jax.tree.map(jnp.copy, logical)  # the all-device step donates its arrays
    l2 = ckpt.logical_state(g2, opt, s2)
    tables = {
        k: (l2.tables[k] if k.split(".")[-1] in CACHED else v) for k, v in logical.tables.items()
    }
    s2 = ckpt.place_state(g2, opt, s2, logical._replace(tables=tables))
    return (
        g2,
        s2,
        jc.RowCache(g2, opt, s2, hosts, params, slot_maps=slot_maps, move_paths=move_paths),
    )


def logical_tables(graphdef, opt, state, cache=None):
    """``{table: {field: array}}``: the all-device state's, or the cache's host tables
    (after a flush) for cached tables."""
    out = {}
    for k, e in ckpt.logical_state(graphdef, opt, state).tables.items():
        name = k.split(".")[-1]
        if cache is not None and name in cache.tables:
            e = dict(cache.tables[name].host.fields, count=e["count"])
        out[name] = {f: np.asarray(x) for f, x in e.items()}
    return out


def dense(state):
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


def assert_tables_equal(got: dict, want: dict) -> None:
    """Every field of every table (from :func:`logical_tables`) equal, bit for bit."""
    assert sorted(got) == sorted(want)
    for t in want:
        assert sorted(got[t]) == sorted(want[t]), t
        for f in want[t]:
            np.testing.assert_array_equal(got[t][f], want[t][f], err_msg=f"{t}.{f}")
