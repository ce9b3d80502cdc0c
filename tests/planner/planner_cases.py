"""Table sets and independent checks shared by the planner tests."""

from __future__ import annotations

import numpy as np

import jaxrec as jr
from jaxrec.distributed.types import ShardingPlan, ShardingType

GiB = 1024**3
MiB = 1024**2


def random_tables(seed: int, count: int, prefix: str = "t") -> list:
    rng = np.random.default_rng(seed)
    return [
        jr.EmbeddingBagConfig(
            name=f"{prefix}{i}",
            num_embeddings=int(rng.choice([100, 10_000, 500_000, 3_000_000])),
            embedding_dim=int(rng.choice([16, 32, 64, 128])),
            data_type=jr.DataType.FP32 if rng.random() < 0.8 else jr.DataType.FP16,
        )
        for i in range(count)
    ]


def padded_table_bytes(plan: ShardingPlan, tables, world: int, state_per_row) -> float:
    """Weights + optimizer state per device, recomputed from the plan as layout.py pads.

    ``state_per_row(ncols) -> bytes``. Independent of the planner's bookkeeping:
    per (columns, dtype) group, every device holds the fullest rank's rows;
    data-parallel tables are full replicas.
    """
    cfg = {t.name: t for t in tables}
    rows: dict[tuple, np.ndarray] = {}
    total = 0.0
    for name, ps in plan.plan[""].items():
        t = cfg[name]
        item = 2 if t.data_type is not jr.DataType.FP32 else 4
        if ps.sharding_type is ShardingType.DATA_PARALLEL:
            total += t.num_embeddings * (t.embedding_dim * item + state_per_row(t.embedding_dim))
            continue
        for s in ps.sharding_spec:
            nr, nc = s.shard_sizes
            if nr and nc:
                key = (nc, item)
                rows.setdefault(key, np.zeros(world, np.int64))[s.placement] += nr
    for (nc, item), r in rows.items():
        total += r.max() * (nc * item + state_per_row(nc))
    return total
