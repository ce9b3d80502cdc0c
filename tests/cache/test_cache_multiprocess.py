"""Cached tables across two processes (2 CPU devices each, gloo collectives): each
process holds its own shards' host rows, plans every shard, and trains exactly as the
all-device model does; a checkpoint written by both restores into either model
(``cache_multiprocess_worker.py``)."""

import json
import os
import sys

import pytest
from processes import free_port, gloo_available, run_processes

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "cache_multiprocess_worker.py")
REPO = os.path.dirname(os.path.dirname(HERE))
TIMEOUT_S = 300
GLOO_UNAVAILABLE = 77


@pytest.mark.skipif(not gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_two_processes_train_and_checkpoint_like_all_device(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # 2 devices per process
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    port = free_port()
    cmds = [[sys.executable, WORKER, str(i), str(port), str(tmp_path)] for i in range(2)]
    codes, outputs = run_processes(cmds, env, TIMEOUT_S)
    if all(c == GLOO_UNAVAILABLE for c in codes):
        pytest.skip("gloo CPU collectives are unavailable: " + outputs[0].strip()[-300:])
    reports = []
    for i, (code, out) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"process {i} exited {code}:\n{out[-4000:]}"
        reports.append(json.loads(next(ln for ln in out.splitlines() if ln.startswith('{"proc'))))
    a, b = reports
    assert a["ok"] and b["ok"], reports
    # each holds its own rows: big's two shards each, mean (rank 2) on process 1 only
    assert a["rows"] == {"big": [0, 100], "mean": [0, 0]}
    assert b["rows"] == {"big": [100, 200], "mean": [0, 120]}
    assert a["stats"] == b["stats"]  # one plan, made on both
    assert "process 1 refused this batch" in a["refused"][0]
    assert "host table 'big' field 'weight'" in b["refused"][0]
