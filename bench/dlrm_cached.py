"""``jaxrec-train-dlrm`` with tables in host memory and a device cache, against all tables
in device memory: the job's training throughput and final AUC.

The job's default synthetic data (300k samples, batch 1024, one epoch, one device)
unless ``--job-flags`` says otherwise; the cached runs keep every table of at least
``--min-rows`` rows in host memory (``--cache-tables``) at each ``--load-factors``
value. Each configuration runs as its own process (the job's ``--quiet
--no-checkpoint``), taking turns in each of ``--reps`` reps so a busy machine slows
them alike; the figures are medians of the job's ``samples_per_s`` (the training
loop, not evaluation) and the ratio of train seconds to the all-device run's in the
same rep. Prints, and appends to ``--out``, one JSON line per configuration, the
machine named in each.

A cached run's initial tables are drawn on the host (``HostTable.create``), not as
the device model draws them, so its AUC differs slightly; the tests check that the
cache's size changes nothing (tests/jobs/test_cached_job.py).

Run from the repository root (about a minute a rep on two cores)::

    python bench/dlrm_cached.py --out bench/results/dlrm_cached_cpu_2core_<date>.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import emit, machine

from jaxrec.jobs import dlrm_parts
from jaxrec.jobs.train_dlrm import parse_args


def run_job(flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "jaxrec.jobs.train_dlrm", "--quiet", "--no-checkpoint"]
        out = subprocess.run(
            [*cmd, "--run-dir", d, *flags], capture_output=True, text=True, check=False
        )
    if out.returncode:
        raise SystemExit(f"job failed ({' '.join(flags)}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job-flags", default="", help="more flags for every run of the job")
    p.add_argument("--min-rows", type=int, default=1000, help="cache tables of this many rows")
    p.add_argument("--load-factors", default="0.5", help="comma-separated cache load factors")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", help="append the JSON lines here")
    a = p.parse_args()
    common = a.job_flags.split()
    train, _ = dlrm_parts.load_data(parse_args(common))
    tables = [
        f"t_{k}"
        for k, n in zip(train.keys, train.num_embeddings_per_feature, strict=True)
        if n >= a.min_rows
    ]
    configs = {"device": common}
    for lf in a.load_factors.split(","):
        flags = ["--cache-tables", ",".join(tables), "--cache-load-factor", lf]
        configs[f"cached_lf{lf}"] = [*common, *flags]
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    for _ in range(a.reps):
        for name, flags in configs.items():
            runs[name].append(run_job(flags))
    base = runs["device"]
    for name, rs in runs.items():
        ratios = [r["train_seconds"] / b["train_seconds"] for r, b in zip(rs, base, strict=True)]
        hit = {
            t: statistics.median(r["cached_tables"][t]["hit_rate"] for r in rs)
            for t in rs[0].get("cached_tables", {})
        }
        rec = {
            "bench": "dlrm_cached",
            "config": name,
            "flags": configs[name],
            "cached_tables": len(hit),
            "reps": a.reps,
            "samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
            "train_seconds_ratio": round(statistics.median(ratios), 3),
            "eval_auc": rs[-1]["eval"]["auc"],
            "hit_rate_median": round(statistics.median(hit.values()), 4) if hit else None,
            "steps": rs[-1]["steps"],
            "load_average": round(os.getloadavg()[0], 2),
            "date": time.strftime("%Y-%m-%d"),
            **machine(),
        }
        emit(rec, a.out)


if __name__ == "__main__":
    main()
