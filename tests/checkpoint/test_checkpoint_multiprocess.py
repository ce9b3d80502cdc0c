"""Save and restore across two processes (2 CPU devices each, gloo collectives).

Launches ``checkpoint_worker.py`` twice: both save one checkpoint of a model
sharded over the 4-device mesh into one directory, restore it under two
layouts and compare with the unsharded model (see the worker's docstring).
"""

import json
import os
import sys

import pytest
from processes import free_port, gloo_available, run_processes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_worker.py")
# the worker's checkpoint_cases imports the sharding cases of tests/distributed
SHARDING_CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed")
TIMEOUT_S = 240
GLOO_UNAVAILABLE = 77


@pytest.mark.skipif(not gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_two_processes_save_and_restore(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # 2 devices per process
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SHARDING_CASES, env.get("PYTHONPATH")]))
    port = free_port()
    cmds = [[sys.executable, WORKER, str(i), str(port), str(tmp_path / "ckpt")] for i in range(2)]
    codes, outputs = run_processes(cmds, env, TIMEOUT_S)
    if all(c == GLOO_UNAVAILABLE for c in codes):
        pytest.skip("gloo CPU collectives are unavailable: " + outputs[0].strip()[-300:])
    for i, (code, out) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"process {i} exited {code}:\n{out[-4000:]}"
        report = json.loads(next(ln for ln in out.splitlines() if ln.startswith('{"process"')))
        assert report["ok"], report
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]
