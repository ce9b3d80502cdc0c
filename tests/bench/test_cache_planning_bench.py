"""bench/cache_planning.py (prepare with each row shard planned by its owner, one
process against two): small tables as a test."""

import json
import os
import subprocess
import sys

import pytest
from processes import gloo_available

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "cache_planning.py")


@pytest.mark.skipif(not gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_two_processes_each_plan_half_the_shards():
    cmd = [
        sys.executable,
        BENCH,
        "--rows",
        "50000",
        "--batch",
        "64",
        "--warmup",
        "2",
        "--reps",
        "3",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    lines = [json.loads(x) for x in out.splitlines() if x.startswith('{"bench"')]
    one = [r for r in lines if r["processes"] == 1]
    two = sorted((r for r in lines if r["processes"] == 2), key=lambda r: r["process"])
    assert len(one) == 1 and len(two) == 2
    assert one[0]["shards_planned"] == 16 and [r["shards_planned"] for r in two] == [8, 8]
    # the same global batches: the owners' misses add up to the one process's
    assert sum(r["planned_misses_per_step"] for r in two) == pytest.approx(
        one[0]["planned_misses_per_step"], abs=2
    )
    for r in lines:
        assert r["cpu"] and r["prepare_ms"] > 0 and r["prepare_cpu_ms"] > 0
