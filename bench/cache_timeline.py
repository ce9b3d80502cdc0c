"""Where a pipelined cached step's time goes: a ``jax.profiler`` trace of it, read back.

Builds ``bench/cache.py``'s model (T tables, row-wise Adagrad, Zipf ids, one cache
load factor) with every table on the device and traces ``--steps`` steps of it in a
``TrainPipeline``; then cached: warms the cache up, traces as many steps waited for
(planned, loaded and run in turn) and in a ``TrainPipeline`` with ``prefetching``.
Each run gets batches it has not seen. Reads each trace (its perfetto JSON) and
prints one JSON line per run (``model``: ``all_device``, ``cached_waited``,
``cached``), medians per step:

- ``interval_ms``: between the starts of consecutive step programs
  (``interval_ratio``: the pipelined cached one over the all-device one);
- ``step_ms`` / ``load_ms``: the train step's and the load's (the moves') programs;
- ``step_ops_ms``: the step program's heaviest ops (means; custom calls by their
  target, e.g. ``jaxrec_kjt_backward_update_rowwise_adagrad``, the others by XLA's
  names);
- ``prepare_ms``: the planning (``jaxrec.cache.prepare``, the pipeline's thread);
- ``write_back_ms``: the main thread's wait for the last load's program;
- ``programs_busy``: the share of the interval some program runs (1: the device
  programs alone are the critical path);
- ``prepare_beside_step``: the share of planning that ran while a step program did.

    python bench/cache_timeline.py                       # CPU: 4 x 1M rows, LFU
    python bench/cache_timeline.py --rows 10000000       # 10 GB of tables
    python bench/cache_timeline.py --preset gpu          # on a GPU machine
The traces stay under ``--trace-dir`` for the perfetto UI (ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import gzip
import itertools
import json
import os
import re
import statistics
import sys
import tempfile

import jax
from cache import PRESETS, Model, batches, cached_model, configs, loss_fn, optimizer, stream
from common import machine
from flax import nnx

from jaxrec import cache as jc
from jaxrec import train


def trace(run, log_dir: str) -> list[dict]:
    """The complete events ("X") of a trace of ``run()``."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python's own calls slow the steps; annotations stay
    with jax.profiler.trace(log_dir, create_perfetto_trace=True, profiler_options=options):
        run()
    path = max(
        glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True),
        key=os.path.getmtime,
    )
    with gzip.open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def pipelined(pipe: train.TrainPipeline, data: list):
    """Runs ``pipe`` over ``data``, its first step before (the pipeline full)."""
    it = iter(data)
    pipe.progress(it)[0].block_until_ready()

    def run():
        loss = None
        while True:
            try:
                loss, _ = pipe.progress(it)
            except StopIteration:
                break
        jax.block_until_ready(loss)

    return run


def program_runs(events: list[dict]) -> dict[str, list[tuple[float, float, dict]]]:
    """Each run of each program (by XLA module name): its span in microseconds (its
    first op's start to its last op's end) and its ops' total time."""
    runs: dict = {}
    for e in events:
        a = e.get("args") or {}
        if "hlo_module" not in a or "run_id" not in a:
            continue
        lo, hi, ops = runs.get((a["hlo_module"], a["run_id"]), (float("inf"), 0.0, {}))
        ops[a.get("hlo_op", e["name"])] = ops.get(a.get("hlo_op", e["name"]), 0.0) + e["dur"]
        runs[a["hlo_module"], a["run_id"]] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]), ops)
    out: dict = {}
    for (module, _), run in runs.items():
        out.setdefault(module, []).append(run)
    return {m: sorted(v, key=lambda r: r[0]) for m, v in out.items()}


def spans(events: list[dict], name: str) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == name)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time (us) in both a span of ``a`` and one of ``b`` (each list sorted, disjoint)."""
    total, j = 0.0, 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            total += max(0.0, min(hi, b[k][1]) - max(lo, b[k][0]))
            k += 1
    return total


def union(runs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list = []
    for lo, hi in sorted(runs):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def custom_call_targets(hlo_text: str) -> dict[str, str]:
    """``{op name: custom call target}`` of a compiled program's text."""
    return dict(
        re.findall(r'^\s*(?:ROOT )?%?([\w.-]+) = .*custom_call_target="([^"]+)"', hlo_text, re.M)
    )


def summarize(events: list[dict], step_module: str, names: dict | None = None) -> dict:
    """Per-step medians of a traced pipeline (see the module's docstring), the
    first and last steps left out (the trace's edges)."""
    runs = program_runs(events)
    if not runs:  # (read on the CPU only so far; a GPU trace may name its runs otherwise)
        raise SystemExit(
            "the trace has no op with an hlo_module and a run_id: this "
            "backend's traces are not read by this script yet"
        )
    steps = runs.get(step_module, [])[1:-1]
    if len(steps) < 2:
        raise SystemExit(
            f"the trace has {len(steps)} inner runs of {step_module!r} "
            f"(programs: {sorted(runs)}): trace more --steps"
        )
    lo, hi = steps[0][0], steps[-1][0]  # whole intervals between the inner steps
    loads = [
        r
        for m, rs in runs.items()
        if "move_inplace" in m or m in ("jit__gather", "jit__scatter")
        for r in rs
        if lo <= r[0] < hi
    ]
    prepare = [s for s in spans(events, "jaxrec.cache.prepare") if lo <= s[0] < hi]
    write_back = [s for s in spans(events, "jaxrec.cache.write_back") if lo <= s[0] < hi]
    n = len(steps) - 1
    every = union([(a, b) for rs in runs.values() for a, b, _ in rs])
    window = [(lo, hi)]
    ops: dict = {}
    for _, _, o in steps:
        for k, v in o.items():
            ops[k] = ops.get(k, 0.0) + v
    heaviest = sorted(ops.items(), key=lambda kv: -kv[1])[:4]
    out = {
        "steps": n,
        "interval_ms": _ms(statistics.median(b[0] - a[0] for a, b in itertools.pairwise(steps))),
        "step_ms": _ms(statistics.median(b - a for a, b, _ in steps)),
        "step_ops_ms": {(names or {}).get(k, k): _ms(v / len(steps)) for k, v in heaviest},
        "programs_busy": round(overlap(every, window) / (hi - lo), 3),
    }
    if loads:
        out["load_ms"] = _ms(sum(b - a for a, b, _ in loads) / n)
    if prepare:
        out["prepare_ms"] = _ms(statistics.median(b - a for a, b in prepare))
        steps_u = union([(a, b) for a, b, _ in steps])
        out["prepare_beside_step"] = round(
            overlap(prepare, steps_u) / sum(b - a for a, b in prepare), 3
        )
    if write_back:
        out["write_back_ms"] = _ms(statistics.median(b - a for a, b in write_back))
    return out


def _ms(us: float) -> float:
    return round(us / 1e3, 3)


def cached_runs(cfg, a, opt, first: list, data: list, log_dir: str) -> tuple[dict, dict]:
    """The cached model warmed up, traced waited for (over ``first``), then in a
    pipeline (over ``data``): the two summaries."""
    state, rc, step = cached_model(cfg, opt, a.load_factor)
    for batch in stream(cfg, a.alpha, a.warmup, seed=1):
        state, loss, _ = step(state, batch)
    state, slots = rc.load_batch(state, first[0])  # (a load donates the state)
    jax.block_until_ready(state)  # no warm-up step left running into the trace
    names = custom_call_targets(step.lower(state, slots).compile().as_text())
    box = {"state": state}

    def waited():  # each step planned, loaded and run in turn (no planning beside it)
        for batch in first[1:]:
            box["state"], loss, _ = step(box["state"], batch)
            loss.block_until_ready()

    alone = summarize(trace(waited, os.path.join(log_dir, "waited")), "jit__step", names)
    pipe = train.TrainPipeline(step, box.pop("state"), to_device=jc.prefetching(rc))
    run = pipelined(pipe, data)
    piped = summarize(trace(run, os.path.join(log_dir, "cached")), "jit__step", names)
    pipe.close()
    rc.close()
    return alone, piped


def device_run(cfg, a, opt, data: list, log_dir: str) -> dict:
    """The same model with every table on the device, traced in a pipeline."""
    graphdef, state = train.init_train_state(Model(configs(cfg), rngs=nnx.Rngs(1)), opt)
    full = train.make_train_step(graphdef, opt, loss_fn)
    names = custom_call_targets(full.lower(state, data[0]).compile().as_text())
    for batch in stream(cfg, a.alpha, min(a.warmup, 50), seed=1):  # (a large table's first
        state, loss, _ = full(state, batch)  # steps map its pages, and collapse them)
        loss.block_until_ready()
    run = pipelined(train.TrainPipeline(full, state, to_device=jax.device_put), data)
    return summarize(trace(run, os.path.join(log_dir, "device")), "jit__step", names)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--rows", type=int, default=None, help="rows per table (default: preset)")
    p.add_argument("--steps", type=int, default=40, help="traced steps per model")
    p.add_argument(
        "--warmup",
        type=int,
        default=1000,
        help="cached steps before the trace (LFU's counts converge slowly)",
    )
    p.add_argument("--algorithm", choices=["lru", "lfu"], default="lfu")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--load-factor", type=float, default=0.1)
    p.add_argument("--trace-dir", default=None, help="where the traces stay (default: a temp dir)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = dataclasses.replace(PRESETS[a.preset], algorithm=a.algorithm)
    if a.rows:
        cfg = dataclasses.replace(cfg, E=a.rows)
    log_dir = a.trace_dir or tempfile.mkdtemp(prefix="cache_timeline_")
    dev = jax.devices()[0]
    base = {
        "bench": "cache_timeline",
        "preset": a.preset,
        "date": datetime.date.today().isoformat(),
        "device": dev.device_kind,
        "platform": dev.platform,
        **machine(),
        "config": dataclasses.asdict(cfg),
        "alpha": a.alpha,
        "load_factor": a.load_factor,
        "trace_dir": log_dir,
    }
    opt = optimizer()
    # batches not seen before by each cached run (seen ones would hit more); the
    # all-device run gets the pipelined run's
    first, data = (batches(cfg, a.alpha, a.steps + 1, seed=s) for s in (7, 8))

    # the all-device model first, as in bench/cache.py: its large tables then get huge
    # pages before the cached model's host tables take memory
    device = device_run(cfg, a, opt, data, log_dir)
    print(json.dumps({**base, "model": "all_device", **device}), flush=True)
    cached = cached_runs(cfg, a, opt, first, data, log_dir)
    cached[1]["interval_ratio"] = round(cached[1]["interval_ms"] / device["interval_ms"], 3)
    for model, r in zip(("cached_waited", "cached"), cached, strict=True):
        print(json.dumps({**base, "model": model, **r}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
