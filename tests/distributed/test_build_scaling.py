"""Build and trace cost follow width groups, not tables (bench/build_compile.py times it).

Structural checks, not timings: the traced train step's equations per added table,
and the programs compiled while a model is built and sharded.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sharding_cases import mesh_1d

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

DIMS = (8, 16)


def _tables(n):
    return [
        jr.EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=DIMS[i % 2],
            num_embeddings=40 + 7 * i,
            feature_names=[f"f{i}"],
            pooling=jr.PoolingType.MEAN if i % 3 == 0 else jr.PoolingType.SUM,
        )
        for i in range(n)
    ]


class Model(nnx.Module):
    def __init__(self, tables, *, rngs):
        self.ebc = jr.EmbeddingBagCollection(tables, rngs=rngs)
        self.head = nnx.Linear(sum(t.embedding_dim for t in tables), 1, rngs=rngs)

    def __call__(self, kjt):
        return self.head(self.ebc(kjt).values())[:, 0]


def _loss(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def _batch(tables, mesh):
    rng = np.random.default_rng(0)
    keys = [t.feature_names[0] for t in tables]
    local = []
    for _ in range(mesh.size):
        lengths = rng.integers(0, 3, 4 * len(tables))
        values = np.concatenate(
            [
                rng.integers(0, t.num_embeddings, lengths[4 * i : 4 * i + 4].sum())
                for i, t in enumerate(tables)
            ]
        )
        kjt = jr.KeyedJaggedTensor.from_lengths_sync(
            keys, values, lengths, capacities={k: 8 for k in keys}
        )
        local.append((kjt, rng.normal(size=4).astype(np.float32)))
    return d.shard_batch(local, mesh)


def _count(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for p in eqn.params.values():
            for x in p if isinstance(p, (tuple, list)) else (p,):
                inner = x if hasattr(x, "eqns") else getattr(x, "jaxpr", None)  # Jaxpr / Closed
                if inner is not None and hasattr(inner, "eqns"):
                    n += _count(inner)
    return n


def _step_equations(n_tables, mesh, plan_for):
    tables = _tables(n_tables)
    model = d.DistributedModelParallel(Model(tables, rngs=nnx.Rngs(0)), plan_for(tables), mesh)
    opt = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, _loss)
    return _count(jax.make_jaxpr(step.jitted)(state, _batch(tables, mesh)).jaxpr)


def _plan(gen):
    def plan_for(tables):
        ebc = d.construct_module_sharding_plan(
            Model(tables, rngs=nnx.Rngs(0)).ebc,
            {t.name: gen(i) for i, t in enumerate(tables)},
            world_size=8,
        )
        return d.ShardingPlan({"ebc": ebc})

    return plan_for


def test_step_equations_per_added_table_are_few():
    """Before, every feature traced its own exchange slices, output block and bounds
    check: about 210 equations per table; now a handful (mostly the sparse update's
    per-table row offsets)."""
    mesh = mesh_1d()
    for name, gen in [
        ("table_wise", lambda i: d.table_wise(i % 8)),
        ("row_wise", lambda i: d.row_wise()),
    ]:
        small = _step_equations(6, mesh, _plan(gen))
        large = _step_equations(18, mesh, _plan(gen))
        per_table = (large - small) / 12
        print(name, small, large, per_table)
        assert per_table <= 30, f"{name}: {per_table:.0f} equations per added table"


def test_sharding_compiles_few_programs():
    """Sharding a collection used to compile an eager slice and cast per table."""
    mesh = mesh_1d()
    model = Model(_tables(24), rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    events = []
    listener = lambda event, duration, **kw: events.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        d.DistributedModelParallel(model, _plan(lambda i: d.row_wise())(_tables(24)), mesh)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    n = sum("backend_compile" in e for e in events)
    assert n <= 6, f"{n} programs compiled to shard 24 tables"
