"""Sharded training across two processes (2 CPU devices each, gloo collectives).

Launches ``multiprocess_worker.py`` twice on 127.0.0.1: the processes form one
4-device mesh through ``jax.distributed.initialize``, train a sharded model
(row-wise, table-wise, column-wise and data-parallel tables) and compare it
with unsharded training on the global batch; each exits non-zero on a mismatch.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")
TIMEOUT_S = 240
GLOO_UNAVAILABLE = 77  # the worker's exit code when gloo cannot be set up


def _gloo_available() -> bool:
    try:
        from jax._src.lib import _jax
    except ImportError:
        return False
    return hasattr(_jax, "make_gloo_tcp_collectives")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not _gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_two_processes_train_like_unsharded():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # 2 devices per process
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(i), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs, deadline = [], time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                logs = [q.communicate()[0][-3000:] for q in procs]
                pytest.fail(f"a worker ran past {TIMEOUT_S} s; output tails:\n" + "\n".join(logs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if all(c == GLOO_UNAVAILABLE for c in codes):
        pytest.skip("gloo CPU collectives are unavailable: " + outputs[0].strip()[-300:])
    for i, (code, out) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"process {i} exited {code}:\n{out[-4000:]}"
        report = json.loads(next(ln for ln in out.splitlines() if ln.startswith('{"process"')))
        assert report["ok"], report
