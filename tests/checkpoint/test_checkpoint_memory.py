"""Saves and restores hold a bounded slice of the tables in host memory, measured: the
peak resident memory of a process (``memory_worker.py``) whose state is ~60 times the
16 MiB staging buffer (and whose largest table is 10 times it)."""

import json
import os
import sys

import pytest
from processes import run_processes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_worker.py")
MEGABYTES = 400  # logical tables and state; the sharded layout pads it to about twice that


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_host_memory_is_bounded(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    codes, outputs = run_processes(
        [[sys.executable, WORKER, str(tmp_path), str(MEGABYTES)]], env, 300
    )
    assert codes == [0], outputs[0][-3000:]
    out = json.loads(next(ln for ln in outputs[0].splitlines() if ln.startswith("{")))
    assert out["equal"], out
    state, staging = out["state_bytes"], out["staging_bytes"]
    bound = 4 * staging + (192 << 20)  # windows in flight, TensorStore, compiled programs
    assert state > 3 * bound, out  # what is measured could not fit under the bound
    # Whole-table gathering (format 1) needed the state again, twice over, on the host.
    assert out["save"] < bound, out
    assert out["async_save"] < out["logical_bytes"] + bound, out  # the pieces' host copy only
    assert out["restore"] < out["restored_bytes"] + bound, out  # the new arrays, no more
