"""A model larger than one H100 built sharded, compiled deviceless: each GPU draws its shards.

The 26 Criteo tables (105 GB fp32 at dim 128; three of 40M rows are 20 GB each) planned
for 8 x 80 GB H100s. ``DistributedModelParallel`` of the model's constructor runs two
kinds of program: one per width group, in which every device draws its own block of
shards (``jaxrec.distributed.shard_init``), and one that builds the dense layers and
the collections' init keys while dropping the table draws
(``jaxrec.distributed.abstract_build``). Each is compiled here for the GPU mesh and
its per-device memory read from the compiler: the group programs' outputs are
exactly the device's shards, their temporaries a bounded block of rows; the dense
program holds no table.
"""

from __future__ import annotations

import time

import deviceless_step as ds
import jax
import jax.numpy as jnp
from compile_runner import Case
from flax import nnx
from step_cases import CRITEO_ROWS, EBC_PATH, _dlrm, _tables

from jaxrec.configs import DataType, data_type_to_dtype
from jaxrec.deviceless import COMPILER_OPTIONS
from jaxrec.distributed.layout import build_layout
from jaxrec.distributed.planner import EmbeddingShardingPlanner, Topology
from jaxrec.distributed.shard_init import GroupDraw, groups_program
from jaxrec.embedding.tables import EmbeddingTable, recording_init_keys


def _mem(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {
        "args": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
    }


def criteo_planned_build(*, dim=128):
    """Every width group's draw program and the dense program, for the planner's plan."""
    tables = _tables(CRITEO_ROWS, dim)
    make = lambda: _dlrm(tables, None, None)  # noqa: E731
    mesh = ds.gpu_mesh("1x1x8")
    topo = Topology(world_size=8, hbm_cap=80 * 1024**3, batch_size=4096)
    plan = EmbeddingShardingPlanner(topo).plan({EBC_PATH: tables})
    layout = build_layout(tables, plan.plan[EBC_PATH], mesh.size)
    t0 = time.perf_counter()
    groups = []
    for g in layout.groups:
        pieces = max(len(r) for r in g.shards)
        args = (
            jax.ShapeDtypeStruct((2,), jnp.uint32),
            (jax.ShapeDtypeStruct((mesh.size, pieces, 6), jnp.int32),),
            (jax.ShapeDtypeStruct((mesh.size, pieces, 2), jnp.float32),),
        )
        dtype = jnp.dtype(data_type_to_dtype(DataType(g.dtype)))
        program = groups_program(mesh, (GroupDraw(g.rows_per_rank, g.ncols, dtype, True),))
        compiled = program.trace(*args).lower().compile(compiler_options=COMPILER_OPTIONS)
        shard_bytes = g.rows_per_rank * g.ncols * dtype.itemsize
        groups.append({"group": g.name, "shard_bytes": shard_bytes, **_mem(compiled)})

    def values():
        with recording_init_keys(draw=False):
            return nnx.state(make(), nnx.Not(EmbeddingTable))

    dense = jax.jit(values).trace().lower().compile(compiler_options=COMPILER_OPTIONS)
    facts = {
        "compile_s": time.perf_counter() - t0,
        "groups": groups,
        "dense": _mem(dense),
        "table_bytes": int(sum(CRITEO_ROWS) * dim * 4),
        "largest_table_bytes": int(max(CRITEO_ROWS) * dim * 4),
        "sharding_types": sorted({p.sharding_type.value for p in plan.plan[EBC_PATH].values()}),
    }
    return dense, facts


CASES = (
    Case(
        name="criteo_planned_build_8x80gb",
        target="build_cases:criteo_planned_build",
        kwargs={},
        timeout_s=600.0,
    ),
)
