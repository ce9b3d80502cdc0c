"""bench/dlrm_cached.py on small data: one all-device run and one cached run, each a
job of its own, reported as the script reports them."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "dlrm_cached.py")


def test_dlrm_cached_small():
    job = "--num-train 2048 --num-eval 512 --batch-size 128"
    argv = ["--job-flags", job, "--reps", "1", "--load-factors", "0.6"]
    out = subprocess.run(
        [sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    device, cached = (json.loads(x) for x in out.stdout.splitlines())
    assert (device["config"], cached["config"]) == ("device", "cached_lf0.6")
    assert device["cached_tables"] == 0 and device["hit_rate_median"] is None
    assert device["train_seconds_ratio"] == 1.0
    assert cached["cached_tables"] == 15  # the synthetic set's tables of 1000 rows
    assert 0.3 < cached["hit_rate_median"] < 1 and cached["train_seconds_ratio"] > 0
    assert device["steps"] == cached["steps"] == 16 and device["cpu"]
