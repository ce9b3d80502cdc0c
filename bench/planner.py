"""Planner benchmark: planning time and plan quality for synthetic table sets.

For each configuration (``T`` tables on ``N`` devices in ``H`` hosts), tables
get rows from {1e3, 1e5, 1e6, 5e6}, dims from {32, 64, 128} and pooling factors
from {1, 10, 50} (seeded), batch 512 per device, 80 GiB HBM, row-wise Adagrad
state. Prints one JSON line per configuration: planning time (median/min/max
over ``--reps``), proposals evaluated, the plan's estimated step time and
per-device HBM, its balance (max / mean own time per device), its padding
(padded over mean unpadded memory per device), the tables it cut by rows and the same
estimates for table-wise round-robin (table ``t`` on rank ``t % N``) when that
fits. No arrays are built.

    python bench/planner.py                # 100x8, 500x64, 1000x128
    python bench/planner.py --configs 500x64x8 --reps 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

import jaxrec
from jaxrec import EmbeddingBagConfig
from jaxrec import distributed as d
from jaxrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

GiB = 1024**3


def tables_for(T: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tables, cons = [], {}
    for t in range(T):
        name = f"t{t}"
        tables.append(
            EmbeddingBagConfig(
                name=name,
                num_embeddings=int(rng.choice([1_000, 100_000, 1_000_000, 5_000_000])),
                embedding_dim=int(rng.choice([32, 64, 128])),
            )
        )
        cons[name] = ParameterConstraints(pooling_factors=[float(rng.choice([1, 10, 50]))])
    return tables, cons


def run(T: int, N: int, H: int, reps: int) -> dict:
    tables, cons = tables_for(T)
    topo = Topology(world_size=N, local_world_size=N // H, hbm_cap=80 * GiB)
    times = []
    for _ in range(reps):
        planner = EmbeddingShardingPlanner(topo, cons)
        start = time.perf_counter()
        plan = planner.plan(tables)
        times.append(time.perf_counter() - start)
    placed, stats = planner.last_placement, planner.last_stats
    rr = d.construct_module_sharding_plan(
        type("Tables", (), {"table_configs": tables}),
        {t.name: d.table_wise(i % N) for i, t in enumerate(tables)},
        world_size=N,
    )
    base = planner.estimate(d.ShardingPlan({"": rr}), tables).placement
    kinds: dict[str, int] = {}
    for p in plan.plan[""].values():
        kinds[p.sharding_type.value] = kinds.get(p.sharding_type.value, 0) + 1
    return {
        "bench": "planner",
        "T": T,
        "N": N,
        "hosts": H,
        "reps": reps,
        "median_s": round(statistics.median(times), 4),
        "min_s": round(min(times), 4),
        "max_s": round(max(times), 4),
        "proposals": stats.proposals,
        "best_from": stats.winner,
        "sharding_types": kinds,
        "est_step_ms": round(placed.perf.total * 1e3, 4),
        "est_hbm_gib": round(placed.hbm / GiB, 3),
        "balance": round(placed.balance, 3),
        "padded_over_mean_unpadded": round(placed.hbm / statistics.mean(placed.own_memory), 3),
        "tables_cut_by_rows": len(placed.split),
        "round_robin_est_step_ms": round(base.perf.total * 1e3, 4),
        "round_robin_est_hbm_gib": round(base.hbm / GiB, 3),
        "round_robin_fits": base.feasible,
        "python": platform.python_version(),
        "jaxrec_version": getattr(jaxrec, "__version__", "?"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="100x8x1,500x64x8,1000x128x16", help="TxNxH,...")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    for c in args.configs.split(","):
        T, N, H = (int(x) for x in c.split("x"))
        print(json.dumps(run(T, N, H, args.reps)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
