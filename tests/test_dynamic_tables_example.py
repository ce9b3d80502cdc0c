"""examples/dynamic_tables.py (8 devices, then 4, beside an unsharded reference) with tiny
arguments, in its own process (it sets up 8 CPU devices before JAX starts)."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]
TINY = [
    "--steps",
    "6",
    "--checkpoint-at",
    "3",
    "--report-every",
    "3",
    "--batch",
    "64",
    "--slots",
    "256",
    "--window",
    "300",
    "--drift",
    "20",
]


def test_dynamic_tables_example_matches_its_unsharded_reference():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "dynamic_tables.py"), *TINY],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "step 3: checkpoint on 8 devices restored on 4" in out
    assert "step   6 on 4 devices" in out
    diff = float(re.search(r"unsharded reference ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-5, out
    for occ in re.findall(r"occupancy (\d+)/256", out):
        assert 0 < int(occ) <= 256
