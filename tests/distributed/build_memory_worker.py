"""Peak host memory of building a sharded model on 8 CPU devices (see test_build_memory.py).

Run as ``python build_memory_worker.py <constructor|eager> <rows per table>``: builds a
model of four tables (``rows`` x 128 fp32 each: row-wise, column-wise and table-row-wise on
either host: 2 GB at 1M rows) sharded over 8 CPU devices, from its constructor or
eagerly (the whole model built, then its shards copied), and prints one JSON line:
``{"table_bytes", "peak_growth", "mode"}``. CPU devices live in host memory, so the
process's peak resident memory (``VmHWM``) grows by at least the shards; building by
shard it should grow by little more. The baseline is taken after JAX has started and
compiled the same draw programs on a small model.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxrec as jr  # noqa: E402
from jaxrec import distributed as d  # noqa: E402

DIM = 128
# Balanced over the 8 ranks (a width group's buffer is as large as its fullest
# rank's shards: balanced, the buffers are the tables' bytes).
PLAN = {
    "rw": d.row_wise(),
    "cw": d.column_wise(list(range(8))),
    "twrw0": d.table_row_wise(0),
    "twrw1": d.table_row_wise(1),
}


class Model(nnx.Module):
    def __init__(self, rows: int):
        tables = [
            jr.EmbeddingBagConfig(
                name=t, embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f_{t}"]
            )
            for t in PLAN
        ]
        self.ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(DIM * len(tables), 1, rngs=nnx.Rngs(1))


def peak_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def build(mode: str, rows: int, mesh) -> nnx.Module:
    abstract = nnx.eval_shape(lambda: Model(rows))
    module = d.construct_module_sharding_plan(abstract.ebc, PLAN, world_size=8, local_size=4)
    plan = d.ShardingPlan({"ebc": module})
    if mode == "constructor":
        return d.DistributedModelParallel(lambda: Model(rows), plan, mesh)
    return d.DistributedModelParallel(Model(rows), plan, mesh)


def main(mode: str, rows: int) -> int:
    mesh = jax.make_mesh((2, 4), ("host", "local"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    jax.block_until_ready(nnx.state(build(mode, 64, mesh)))  # start JAX, compile alike programs
    before = peak_kib()
    model = build(mode, rows, mesh)
    jax.block_until_ready(nnx.state(model))
    growth = (peak_kib() - before) * 1024
    table_bytes = len(PLAN) * rows * DIM * 4
    buffers = sum(v.get_value().nbytes for v in model.ebc.weights.values())
    print(
        json.dumps(
            {
                "mode": mode,
                "table_bytes": table_bytes,
                "buffer_bytes": buffers,
                "peak_growth": growth,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
