"""A dynamic table's hash index on CPU: the C++ kernel against the XLA program.

Times ``jaxrec.modules.zch_index.train_step`` (on CPU: the C++ kernel
``jaxrec_zch_train_step``) and ``train_step_xla`` for one table of ``--slots``
slots and batches of ``--ids`` Zipf ids (64-bit: high words set) drawn from a
universe ``--universe`` times the table, drifting each call so that ids keep
arriving and being evicted. Per implementation: the compile time of the jitted
call (``lower().compile()``, median of ``--compile-reps``) and the wall time of a
call (state donated, median of ``--reps`` after the table is warmed full by
``--warm`` calls). Both run the same batches from the same state and must agree
bit for bit (the run exits 1 otherwise). One JSON line is printed, and appended to
``--out`` when given::

    python bench/zch_kernel.py --out bench/results/zch_cpu_kernel_<cpu>_2core_<date>.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import cpu_model
from specs import zipf_ids

from jaxrec.modules import zch_index as zi
from jaxrec.modules.zch_policies import (
    FrequencyAdmission,
    HashZchEvictionConfig,
    HashZchEvictionPolicyName,
)
from jaxrec.sparse.ids64 import to_id_words

POLICIES = {
    "lru": HashZchEvictionPolicyName.LRU_EVICTION,
    "lfu": HashZchEvictionPolicyName.LFU_EVICTION,
}


def cpu_model_number() -> int | None:
    """``/proc/cpuinfo``'s model number (the model name of a VM's CPU can be generic)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() == "model":
                    return int(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return None


def batches(args, rng, n):
    """``n`` batches (lo, hi, valid) of Zipf ids from a window of the universe that drifts."""
    universe = args.universe * args.slots
    out = []
    for k in range(n):
        rank = zipf_ids(rng, universe, args.alpha, args.ids).astype(np.uint64)
        ids = (rank + np.uint64(k * args.drift)) * np.uint64(0x9E37_79B9) + np.uint64(2**40)
        w = jnp.asarray(to_id_words(ids))
        out.append((w[:, 0], w[:, 1], jnp.ones(args.ids, bool)))
    return out


def compile_s(fn, args, reps):
    """``(trace + lower + compile, compile alone)`` seconds per rep, JAX's caches cleared."""
    total, compile_only = [], []
    for _ in range(reps):
        jax.clear_caches()
        start = time.perf_counter()
        lowered = jax.jit(fn, donate_argnums=0).lower(*args)
        mid = time.perf_counter()
        lowered.compile()
        end = time.perf_counter()
        total.append(end - start)
        compile_only.append(end - mid)
    return total, compile_only


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=2**20)
    p.add_argument("--ways", type=int, default=16)
    p.add_argument("--ids", type=int, default=2**16)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--universe", type=int, default=4, help="distinct ids / slots")
    p.add_argument("--drift", type=int, default=4096, help="universe ranks a call moves by")
    p.add_argument("--policy", choices=sorted(POLICIES), default="lru")
    p.add_argument("--threshold", type=int, default=0, help="frequency admission (0: none)")
    p.add_argument("--warm", type=int, default=30)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--compile-reps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    layout = zi.ZchLayout(
        slots=args.slots,
        ways=args.ways,
        total_buckets=args.slots // args.ways,
        eviction=HashZchEvictionConfig(policy=POLICIES[args.policy]),
        admission=FrequencyAdmission(threshold=args.threshold) if args.threshold else None,
    )
    impls = {"xla": zi.train_step_xla, "cpu_kernel": zi.train_step}
    fns = {k: functools.partial(f, layout, max_evictions=args.ids) for k, f in impls.items()}
    rng = np.random.default_rng(0)
    warm = batches(args, rng, args.warm)
    timed = batches(args, rng, args.reps)

    result = {
        "bench": "zch_kernel",
        "cpu": cpu_model(),
        "cpu_model_number": cpu_model_number(),
        "cores": os.cpu_count(),
        "jax_version": jax.__version__,
        "slots": args.slots,
        "ways": args.ways,
        "ids": args.ids,
        "alpha": args.alpha,
        "universe": args.universe,
        "drift": args.drift,
        "policy": args.policy,
        "admission": f"frequency({args.threshold})" if args.threshold else None,
        "max_evictions": args.ids,
    }
    program = jax.jit(fns["cpu_kernel"], donate_argnums=0)
    state = zi.empty_state(layout)
    for lo, hi, valid in warm:  # a full table, as in a long run
        state = program(state, lo, hi, valid).state
    result["occupancy"] = int(state.occupancy)
    base = jax.tree.map(np.asarray, state)

    outputs = {}
    for name, fn in fns.items():
        total, c = compile_s(fn, (state, *warm[0]), args.compile_reps)
        step = jax.jit(fn, donate_argnums=0)
        s = jax.tree.map(jnp.asarray, base)
        step(jax.tree.map(jnp.asarray, base), *warm[0])  # compiled, outside the timing
        times, rows = [], []
        for lo, hi, valid in timed:
            jax.block_until_ready((s, lo, hi, valid))
            start = time.perf_counter()
            out = jax.block_until_ready(step(s, lo, hi, valid))
            times.append((time.perf_counter() - start) * 1e3)
            s = out.state
            rows.append(np.asarray(out.rows))
        outputs[name] = (jax.tree.map(np.asarray, s), rows, np.asarray(out.evicted))
        result[name] = {
            "compile_s_median": round(statistics.median(c), 4),
            "trace_lower_compile_s_median": round(statistics.median(total), 4),
            "compile_s": [round(x, 4) for x in c],
            "run_ms_median": round(statistics.median(times), 3),
            "run_ms_min": round(min(times), 3),
            "admitted_last": int(out.counts.admitted),
            "evicted_last": int(out.counts.evicted),
        }
    same = all(
        np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(outputs["xla"]), jax.tree.leaves(outputs["cpu_kernel"]), strict=True
        )
    )
    result["bit_identical"] = same
    x, k = result["xla"], result["cpu_kernel"]
    result["compile_speedup"] = round(x["compile_s_median"] / k["compile_s_median"], 1)
    result["trace_lower_compile_speedup"] = round(
        x["trace_lower_compile_s_median"] / k["trace_lower_compile_s_median"], 1
    )
    result["run_speedup"] = round(x["run_ms_median"] / k["run_ms_median"], 1)
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
