"""The fused backward's work plan on the GPU presets: what each program would walk.

No kernel runs: this reads ``jaxrec.pallas.runs``' plan (a sort, then per level
a cumulative sum and a search) for the ids of ``bench/gpu_lookup.py``'s presets
and counts, per launch, what each program of ``block_rows`` lanes walks
(``program_loads``): its chain (the longest run or piece it sums: the serial
steps) and its items. Beside it, the same for the first schedule
(``piece_len=None``: one program per run, whose chain is the hottest row's
count). That is the structural side of issue 47's skew problem, on the real
preset sizes; the time it buys needs a GPU (``bench/gpu_lookup.py``).

    python bench/backward_plan.py --preset target,target_zipf,hbm_check
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from common import cpu_model
from gpu_lookup import all_presets
from specs import LookupSpec, make_inputs

from jaxrec.pallas.runs import DEFAULT_PIECE_LEN, piece_layout, plan_runs, program_loads

BENCH = "backward_plan"
BLOCK_ROWS = 8  # the update kernel's default tiling (jaxrec.pallas.update.DEFAULT_TILING)


def plan_stats(spec: LookupSpec, piece_len: int | None, seed: int = 0) -> dict:
    """Per launch of the plan for ``spec``'s ids: programs, their longest chain, items."""
    values = make_inputs(spec, seed)["values"]
    c = values.shape[0]
    rows = values + np.repeat(np.arange(spec.T), spec.B * spec.L) * spec.E
    layout = piece_layout(c, piece_len)
    plan = jax.jit(plan_runs, static_argnums=(4, 5))(
        jnp.asarray(rows, jnp.int32),
        jnp.ones(c, bool),
        jnp.zeros(c, jnp.int32),
        jnp.ones(c, jnp.float32),
        spec.T * spec.E,
        layout,
    )
    launches = []
    for load in program_loads(plan, BLOCK_ROWS):
        busy = load.items[load.items > 0]
        launches.append(
            {
                "programs": int(load.items.shape[0]),
                "busy_programs": int(busy.size),
                "max_chain": int(load.chain.max()),
                "max_items": int(load.items.max()),
                "mean_busy_items": round(float(busy.mean()), 2) if busy.size else 0.0,
            }
        )
    counts = np.bincount(rows)
    return {
        "bench": BENCH,
        **spec.as_dict(),
        "piece_len": piece_len,
        "block_rows": BLOCK_ROWS,
        "ids": int(c),
        "unique_rows": int(np.count_nonzero(counts)),
        "hottest_row_ids": int(counts.max()),
        "reductions": len(layout.sizes),
        "partial_rows": layout.total,
        "partial_bytes": layout.total * spec.D * 4,
        "launches": launches,
        "longest_chain": max(x["max_chain"] for x in launches),
        "cpu": cpu_model(),
        "jax_version": jax.__version__,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="target,target_zipf", help="bench/gpu_lookup.py presets")
    p.add_argument("--piece-len", type=int, default=DEFAULT_PIECE_LEN)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    presets = all_presets()
    unknown = [n for n in args.preset.split(",") if n not in presets]
    if unknown:
        raise SystemExit(f"unknown presets {unknown}; choose from {sorted(presets)}")
    for name in args.preset.split(","):
        for spec in presets[name]:
            for piece_len in (args.piece_len, None):
                print(json.dumps({"preset": name, **plan_stats(spec, piece_len, args.seed)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
