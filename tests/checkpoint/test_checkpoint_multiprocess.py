"""Save and restore across two processes (2 CPU devices each, gloo collectives).

Launches ``checkpoint_worker.py`` twice: both save one checkpoint of a model
sharded over the 4-device mesh into one directory, restore it under two
layouts and compare with the unsharded model (see the worker's docstring).
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_worker.py")
# the worker's checkpoint_cases imports the sharding cases of tests/distributed
SHARDING_CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed")
TIMEOUT_S = 240
GLOO_UNAVAILABLE = 77


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
def test_two_processes_save_and_restore(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # 2 devices per process
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SHARDING_CASES, env.get("PYTHONPATH")]))
    port = _free_port()
    cmd = lambda i: [sys.executable, WORKER, str(i), str(port), str(tmp_path / "ckpt")]
    procs = [
        subprocess.Popen(cmd(i), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
        for i in range(2)
    ]  # fmt: skip
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
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1"]
