"""Dry run: ``python -m jaxrec.distributed.planner --tables tables.json --devices 8``.

Prints the plan and the planner's stats without building any arrays; with
``--plan-out`` writes the plan as JSON (``ShardingPlan.from_json`` reads it).
"""

from __future__ import annotations

import argparse
import sys

from .planner import EmbeddingShardingPlanner, PlannerError
from .table_specs import load_table_specs
from .topology import GiB, Topology


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxrec.distributed.planner", description=__doc__)
    p.add_argument("--tables", required=True, help="table spec, .json or .csv")
    p.add_argument("--devices", type=int, help="world size (default: the spec's, else 8)")
    p.add_argument("--local-devices", type=int, help="devices per host (default: all)")
    p.add_argument("--hbm-gib", type=float, help="device memory per device, GiB (default 32)")
    p.add_argument("--ddr-gib", type=float, help="host memory per host, GiB (default 128)")
    p.add_argument("--batch-size", type=int, help="samples per device (default 512)")
    p.add_argument("--hbm-bw-gbps", type=float, help="device memory bandwidth, GB/s")
    p.add_argument("--intra-host-bw-gbps", type=float, help="per-device bandwidth in a host, GB/s")
    p.add_argument("--cross-host-bw-gbps", type=float, help="per-device bandwidth across, GB/s")
    p.add_argument("--compute-device", help="cuda, tpu or cpu (printing only)")
    p.add_argument("--optimizer", help="sparse optimizer whose state is sized (rowwise_adagrad)")
    p.add_argument("--capacity", type=int, help="ids per destination (DMP's capacity=)")
    p.add_argument("--reserved", type=float, default=0.15, help="reserved HBM fraction (0.15)")
    p.add_argument("--reserved-ddr", type=float, default=0.1, help="reserved host fraction (0.1)")
    p.add_argument("--plan-out", help="write the plan as JSON to this file")
    p.add_argument("--quiet-plan", action="store_true", help="print the stats only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    tables, constraints, settings = load_table_specs(args.tables)
    topo = dict(settings.get("topology", {}))
    flags = {
        "world_size": args.devices,
        "local_world_size": args.local_devices,
        "hbm_cap": None if args.hbm_gib is None else int(args.hbm_gib * GiB),
        "ddr_cap": None if args.ddr_gib is None else int(args.ddr_gib * GiB),
        "batch_size": args.batch_size,
        "hbm_mem_bw": None if args.hbm_bw_gbps is None else args.hbm_bw_gbps * 1e9,
        "intra_host_bw": None if args.intra_host_bw_gbps is None else args.intra_host_bw_gbps * 1e9,
        "cross_host_bw": None if args.cross_host_bw_gbps is None else args.cross_host_bw_gbps * 1e9,
        "compute_device": args.compute_device,
    }
    topo.update({k: v for k, v in flags.items() if v is not None})
    topo.setdefault("world_size", 8)
    planner = EmbeddingShardingPlanner(
        Topology(**topo),
        constraints,
        optimizer=args.optimizer or settings.get("optimizer"),
        capacity=args.capacity if args.capacity is not None else settings.get("capacity"),
        reserved_hbm_fraction=args.reserved,
        reserved_ddr_fraction=args.reserved_ddr,
    )
    try:
        plan = planner.plan(tables)
    except PlannerError as e:
        print(f"PlannerError: {e}", file=sys.stderr)
        return 2
    if not args.quiet_plan:
        print(plan)
        print()
    print(planner.last_stats)
    if args.plan_out:
        with open(args.plan_out, "w") as f:
            f.write(plan.to_json())
        print(f"\nplan written to {args.plan_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
