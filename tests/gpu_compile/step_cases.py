"""jaxrec's train step compiled deviceless for H100s: a DLRM on one GPU and sharded on 8.

Each case builds the model and its train state under ``jax.eval_shape`` (see
``bench/deviceless_step.py``), so tables far larger than this machine's memory
compile: the unsharded DLRM holds 41 GB of tables, the planned one 105 GB over
8 GPUs. Cases cover every sharding type once, grouped in one model per
topology: ``1x1x8`` (one host, 8 GPUs) takes all seven types (the host-based
ones then span the one host), ``1x2x4`` (2 hosts x 4) the host-based types
across hosts. Each returns XLA's per-device memory and, for sharded models,
the planner's estimate of the same plan (``facts["memory"]``), and the
collectives of the compiled program (``facts["collectives"]``).
"""

from __future__ import annotations

import time

import deviceless_step as ds
import jax
import jax.numpy as jnp
import optax
from compile_runner import Case
from flax import nnx

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import optim
from jaxrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from jaxrec.embedding import CombinedOptimizer
from jaxrec.models import DLRM

EBC_PATH = "sparse_arch.embedding_bag_collection"
DENSE = 13  # Criteo's dense features
# MLPerf DLRM-DCNv2's 26 Criteo 1TB tables (rows): 105 GB in fp32 at dim 128.
CRITEO_ROWS = (
    40_000_000,
    39_060,
    17_295,
    7_424,
    20_265,
    3,
    7_122,
    1_543,
    63,
    40_000_000,
    3_067_956,
    405_282,
    10,
    2_209,
    11_938,
    155,
    4,
    976,
    14,
    40_000_000,
    40_000_000,
    40_000_000,
    590_152,
    12_973,
    108,
    36,
)
# One table per sharding type (1x1x8) and the host-based ones across 2 hosts (1x2x4).
PLANS = {
    "1x1x8": {
        "table_wise": d.table_wise(3),
        "row_wise": d.row_wise(),
        "column_wise": d.column_wise([1, 6]),
        "data_parallel": d.data_parallel(),
        "table_row_wise": d.table_row_wise(0),
        "table_column_wise": d.table_column_wise(0, 4),
        "grid_shard": d.grid_shard([0]),
    },
    "1x2x4": {
        "table_row_wise": d.table_row_wise(1),
        "table_column_wise": d.table_column_wise(0),
        "grid_shard": d.grid_shard([1, 0]),
        "table_wise": d.table_wise(5),
    },
}


def _tables(rows, dim: int, names=None) -> list[jr.EmbeddingBagConfig]:
    names = names or [f"t{i}" for i in range(len(rows))]
    return [
        jr.EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=r, feature_names=[f"f_{n}"])
        for n, r in zip(names, rows, strict=True)
    ]


def _dlrm(tables, implementation, bounds_check):
    kw = {} if bounds_check is None else {"bounds_check_mode": jr.BoundsCheckMode[bounds_check]}
    ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0), implementation=implementation, **kw)
    dim = tables[0].embedding_dim
    return DLRM(ebc, DENSE, [512, 256, dim], [512, 256, 1], rngs=nnx.Rngs(1))


def _loss(model, batch):
    dense, kjt, labels = batch
    return optax.sigmoid_binary_cross_entropy(model(dense, kjt)[:, 0], labels).mean()


def _local_batch(tables, batch: int, ids_per_bag: int):
    """One device's batch, abstract: dense ``[B, 13]``, a KJT with ``B * L`` ids per key, labels."""
    keys = [f for t in tables for f in t.feature_names]
    n = len(keys)

    def kjt():
        return jr.KeyedJaggedTensor(
            keys,
            jnp.zeros(n * batch * ids_per_bag, jnp.int32),
            lengths=jnp.full((n * batch,), ids_per_bag, jnp.int32),
            capacities=(batch * ids_per_bag,) * n,
        )

    f32 = jnp.float32
    return (
        jax.ShapeDtypeStruct((batch, DENSE), f32),
        jax.eval_shape(kjt),
        jax.ShapeDtypeStruct((batch,), f32),
    )


def _optimizer():
    return CombinedOptimizer(optax.adam(1e-3), optim.rowwise_adagrad(0.01))


def _collectives(compiled) -> dict[str, int]:
    """Count of each collective op (``-start`` forms as XLA's async GPU collectives)."""
    counts: dict[str, int] = {}
    for line in compiled.as_text().splitlines():
        for op in (
            "ragged-all-to-all",
            "all-to-all",
            "all-gather",
            "all-reduce",
            "reduce-scatter",
            "collective-permute",
        ):
            for form in (f" {op}(", f" {op}-start("):
                if form in line:
                    counts[form.strip(" (")] = counts.get(form.strip(" ("), 0) + 1
    return counts


def _kernels(compiled) -> dict[str, int]:
    """Custom calls of the GPU program: Pallas (Triton) kernels, and jaxrec's CPU FFI targets
    (which must never land in a GPU program: the lowering platform picks the branch)."""
    text = compiled.as_text()
    return {
        "triton": text.count('custom_call_target="__gpu$xla.gpu.triton"'),
        "cpu_ffi": text.count('custom_call_target="jaxrec_'),
    }


def dlrm_unsharded(
    *,
    rows=10_000_000,
    num_tables=8,
    dim=128,
    batch=4096,
    ids_per_bag=20,
    implementation=None,
    bounds_check=None,
):
    """One H100: 8 tables of 10M x 128 fp32 (41 GB), row-wise Adagrad, batch 4096 x 20 ids."""
    tables = _tables([rows] * num_tables, dim)
    mesh = ds.gpu_mesh("1x1x1")
    t0 = time.perf_counter()
    compiled, state = ds.compile_train_step(
        lambda: _dlrm(tables, implementation, bounds_check),
        _optimizer(),
        _loss,
        _local_batch(tables, batch, ids_per_bag),
        mesh,
        implementation=implementation,
        sharded=False,
    )
    facts = {
        "compile_s": time.perf_counter() - t0,
        "memory": ds.memory_report(compiled, state),
        "table_bytes": rows * num_tables * dim * 4,
        "kernels": _kernels(compiled),
    }
    return compiled, facts


def _sharded(
    tables, plan, topology, batch, ids_per_bag, implementation, bounds_check, exchange="padded"
):
    mesh = ds.gpu_mesh(topology)
    opt = _optimizer()

    def build():
        model = _dlrm(tables, implementation, bounds_check)
        return d.DistributedModelParallel(model, plan, mesh, exchange=exchange)

    t0 = time.perf_counter()
    compiled, state = ds.compile_train_step(
        build,
        opt,
        _loss,
        _local_batch(tables, batch, ids_per_bag),
        mesh,
        implementation=implementation,
    )
    seconds = time.perf_counter() - t0
    _, hosts, local = (int(x) for x in topology.split("x"))
    estimate = ds.planner_estimate(
        plan,
        {EBC_PATH: tables},
        world_size=hosts * local,
        local_world_size=local,
        batch_size=batch,
        capacities={t.name: [batch * ids_per_bag] for t in tables},
        optimizer=opt,
    )
    facts = {
        "compile_s": seconds,
        "memory": ds.memory_report(compiled, state, estimate),
        "collectives": _collectives(compiled),
        "kernels": _kernels(compiled),
    }
    return compiled, facts


def dlrm_sharded(
    *,
    topology="1x1x8",
    rows=10_000_000,
    dim=128,
    batch=4096,
    ids_per_bag=20,
    implementation=None,
    bounds_check=None,
    exchange="padded",
):
    """One table (10M x 128) per sharding type of ``PLANS[topology]``, on 8 H100s
    (``exchange="ragged"``: ids and pooled blocks by ``ragged_all_to_all``)."""
    gens = PLANS[topology]
    tables = _tables([rows] * len(gens), dim, names=list(gens))
    _, hosts, local = (int(x) for x in topology.split("x"))
    ebc = nnx.eval_shape(lambda: jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0)))
    module = d.construct_module_sharding_plan(ebc, gens, world_size=hosts * local, local_size=local)
    plan = d.ShardingPlan({EBC_PATH: module})
    return _sharded(
        tables, plan, topology, batch, ids_per_bag, implementation, bounds_check, exchange
    )


def dlrm_planned(*, batch=4096, ids_per_bag=20, implementation=None, bounds_check=None):
    """The 26 Criteo tables (105 GB fp32, dim 128) planned by the planner for 8 x 80 GB."""
    tables = _tables(CRITEO_ROWS, 128)
    topo = Topology(world_size=8, hbm_cap=80 * 1024**3, batch_size=batch)
    cons = {t.name: ParameterConstraints(feature_capacities=[batch * ids_per_bag]) for t in tables}
    planner = EmbeddingShardingPlanner(topo, cons, optimizer=_optimizer())
    plan = planner.plan({EBC_PATH: tables})
    compiled, facts = _sharded(
        tables, plan, "1x1x8", batch, ids_per_bag, implementation, bounds_check
    )
    facts["sharding_types"] = sorted({p.sharding_type.value for p in plan.plan[EBC_PATH].values()})
    return compiled, facts


# The defaults (implementation=None, resolved for the lowering platform: the
# Pallas kernels here; BoundsCheckMode.WARNING, reported as step outputs) are
# what a user gets, so that is what compiles; one case forces "pallas".
_NOW: dict = {}
STEP_TIMEOUT_S = 600.0  # a sharded step compiles in ~30 s on 2 busy cores
CASES = (
    Case(
        name="dlrm_unsharded_1gpu",
        target="step_cases:dlrm_unsharded",
        kwargs=_NOW,
        timeout_s=STEP_TIMEOUT_S,
    ),
    Case(
        name="dlrm_unsharded_1gpu_pallas",
        target="step_cases:dlrm_unsharded",
        kwargs={**_NOW, "implementation": "pallas"},
        timeout_s=STEP_TIMEOUT_S,
    ),
    Case(
        name="dlrm_sharded_1x1x8_every_type",
        target="step_cases:dlrm_sharded",
        kwargs={**_NOW, "topology": "1x1x8"},
        timeout_s=STEP_TIMEOUT_S,
    ),
    # the ragged exchange (ids and pooled blocks) has the padded one's buffers
    Case(
        name="dlrm_sharded_1x2x4_host_types",
        target="step_cases:dlrm_sharded",
        kwargs={**_NOW, "topology": "1x2x4", "exchange": "ragged"},
        timeout_s=STEP_TIMEOUT_S,
    ),
    Case(
        name="dlrm_planned_8x80gb",
        target="step_cases:dlrm_planned",
        kwargs=_NOW,
        timeout_s=STEP_TIMEOUT_S,
    ),
)
