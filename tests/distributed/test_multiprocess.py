"""Sharded training across two processes (2 CPU devices each, gloo collectives).

Launches ``multiprocess_worker.py`` twice on 127.0.0.1: the processes form one
4-device mesh through ``jax.distributed.initialize``, train a sharded model
(row-wise, table-wise, column-wise and data-parallel tables) and compare it
with unsharded training on the global batch; each exits non-zero on a mismatch.
"""

import json
import os
import sys

import pytest
from processes import free_port, gloo_available, run_processes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")
TIMEOUT_S = 240
GLOO_UNAVAILABLE = 77  # the worker's exit code when gloo cannot be set up


@pytest.mark.skipif(not gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_two_processes_train_like_unsharded():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # 2 devices per process
    port = free_port()
    cmds = [[sys.executable, WORKER, str(i), str(port)] for i in range(2)]
    codes, outputs = run_processes(cmds, env, TIMEOUT_S)
    if all(c == GLOO_UNAVAILABLE for c in codes):
        pytest.skip("gloo CPU collectives are unavailable: " + outputs[0].strip()[-300:])
    for i, (code, out) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"process {i} exited {code}:\n{out[-4000:]}"
        report = json.loads(next(ln for ln in out.splitlines() if ln.startswith('{"process"')))
        assert report["ok"], report
