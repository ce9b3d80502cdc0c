"""The cached step compiled deviceless for an H100: the slot-map plan and the train step
over slot tables, with abstract inputs only (no table, no slot map is allocated).

Production-like sizes: tables of 50M rows x 128 dims fp32 (25.6 GB each, 102.4 GB for
4) cached at load factor 0.05 (2.5M slots each), batch 8192 x 20 ids per table.

- ``plan_table``: one table's :func:`jaxrec.cache.sets.plan_sets` (LRU or LFU), the
  program's memory against its slot map and the batch's ids;
- ``plan_batch``: ``device_maps._plan_batch``, the one program ``RowCache`` runs per
  batch, over ``tables`` tables whose features share one KJT (as a batch has them).
  Each table's plan scans the whole KJT's values (masked to its span), so its ids
  are ``tables x B x L`` per table. 2 tables: the program compiles in ~11 s on 2 busy
  cores, 4 in ~100 s (LLVM's CodeGenPrepare on fusions that grow with the tables);
- ``cached_step``: the DLRM train step of ``step_cases`` on the slot tables of
  ``jaxrec.cache.cached_configs``, its arguments against the slot and logical tables.

Each returns ``(compiled, facts)``: the sizes the tests' bounds are written in.
"""

from __future__ import annotations

import functools
import time

import deviceless_step as ds
import jax
import jax.numpy as jnp
import step_cases as sc
from compile_runner import Case

from jaxrec import cache as jc
from jaxrec import deviceless
from jaxrec.cache import device_maps, sets
from jaxrec.distributed.types import CacheAlgorithm

ROWS, DIM, LOAD_FACTOR = 50_000_000, 128, 0.05
BATCH, IDS_PER_BAG = 8192, 20


def _layout(rows: int, load_factor: float, algorithm: str) -> sets.SetLayout:
    return sets.set_layout(
        rows,
        1,
        jc.slots_per_shard(rows, 1, jc.CacheParams(load_factor=load_factor)),
        CacheAlgorithm(algorithm),
    )


def _state(layout: sets.SetLayout, mesh) -> sets.SlotState:
    return deviceless.abstract_like(jax.eval_shape(lambda: sets.empty_state(layout)), mesh)


def _facts(layout, tables: int, ids_scanned: int, dim: int, seconds: float) -> dict:
    return {
        "compile_s": round(seconds, 2),
        "tables": tables,
        "rows": layout.rows,
        "total_slots": layout.total_slots * tables,
        "ways": layout.ways,
        "ids": ids_scanned,  # summed over the tables' plans
        "lfu_rows": layout.rows * tables if layout.algorithm is CacheAlgorithm.LFU else 0,
        "table_bytes": layout.rows * dim * 4 * tables,
    }


def plan_table(
    *,
    algorithm="lru",
    rows=ROWS,
    dim=DIM,
    load_factor=LOAD_FACTOR,
    batch=BATCH,
    ids_per_bag=IDS_PER_BAG,
):
    """One table's ``plan_sets`` (state donated, as ``RowCache`` runs it)."""
    layout = _layout(rows, load_factor, algorithm)
    mesh = deviceless.mesh(deviceless.topology("1x1x1"))
    n = batch * ids_per_bag
    ids = deviceless.abstract((n,), jnp.int32, mesh)
    valid = deviceless.abstract((n,), jnp.bool_, mesh)
    t0 = time.perf_counter()
    program = jax.jit(functools.partial(sets.plan_sets, layout), donate_argnums=0)
    compiled = (
        program.trace(_state(layout, mesh), ids, valid)
        .lower()
        .compile(compiler_options=deviceless.COMPILER_OPTIONS)
    )
    return compiled, _facts(layout, 1, n, dim, time.perf_counter() - t0)


def plan_batch(
    *,
    tables=2,
    algorithm="lru",
    rows=ROWS,
    dim=DIM,
    load_factor=LOAD_FACTOR,
    batch=BATCH,
    ids_per_bag=IDS_PER_BAG,
):
    """``device_maps._plan_batch`` over ``tables`` tables, one feature each in one KJT."""
    layout = _layout(rows, load_factor, algorithm)
    mesh = deviceless.mesh(deviceless.topology("1x1x1"))
    cap = batch * ids_per_bag  # each table's feature: its static slice of the values
    routes = tuple(device_maps._Route(f"t{i}", layout, ((0, i * cap, cap),)) for i in range(tables))
    n = tables * cap  # the KJT's values: every table's ids
    states = tuple(_state(layout, mesh) for _ in routes)
    values = (deviceless.abstract((n,), jnp.int32, mesh),)
    bounds = deviceless.abstract((tables,), jnp.int32, mesh)  # each feature's length
    t0 = time.perf_counter()
    program = jax.jit(functools.partial(device_maps._plan_batch, routes, (0,)), donate_argnums=0)
    compiled = (
        program.trace(states, values, bounds)
        .lower()
        .compile(compiler_options=deviceless.COMPILER_OPTIONS)
    )
    return compiled, _facts(layout, tables, n, dim, time.perf_counter() - t0)


def cached_step(
    *, tables=4, rows=ROWS, dim=DIM, load_factor=LOAD_FACTOR, batch=BATCH, ids_per_bag=IDS_PER_BAG
):
    """The DLRM train step (row-wise Adagrad) on ``tables`` cached tables' slot tables."""
    logical = sc._tables([rows] * tables, dim)
    params = {t.name: jc.CacheParams(load_factor=load_factor) for t in logical}
    slot_tables = jc.cached_configs(logical, params)
    mesh = ds.gpu_mesh("1x1x1")
    t0 = time.perf_counter()
    compiled, state = ds.compile_train_step(
        lambda: sc._dlrm(slot_tables, None, None),
        sc._optimizer(),
        sc._loss,
        sc._local_batch(slot_tables, batch, ids_per_bag),
        mesh,
        sharded=False,
    )
    slots = sum(t.num_embeddings for t in slot_tables)
    facts = {
        "compile_s": round(time.perf_counter() - t0, 2),
        "memory": ds.memory_report(compiled, state),
        "slots": slots,
        "slot_table_bytes": slots * dim * 4,
        "logical_table_bytes": sum(t.cached_rows for t in slot_tables) * dim * 4,
        "kernels": sc._kernels(compiled),
    }
    return compiled, facts


PLAN_TIMEOUT_S, STEP_TIMEOUT_S = 300.0, 600.0
# The step first: one worker compiles it while the other takes the plans.
CASES = (
    Case(
        name="cached_step_4_tables",
        target="cached_step_cases:cached_step",
        kwargs={"tables": 4},
        timeout_s=STEP_TIMEOUT_S,
    ),
    Case(
        name="plan_table_lru",
        target="cached_step_cases:plan_table",
        kwargs={"algorithm": "lru"},
        timeout_s=PLAN_TIMEOUT_S,
    ),
    Case(
        name="plan_table_lfu",
        target="cached_step_cases:plan_table",
        kwargs={"algorithm": "lfu"},
        timeout_s=PLAN_TIMEOUT_S,
    ),
    Case(
        name="plan_batch_2_tables",
        target="cached_step_cases:plan_batch",
        kwargs={"tables": 2},
        timeout_s=PLAN_TIMEOUT_S,
    ),
)
