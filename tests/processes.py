"""Launching test processes on 127.0.0.1: a free port, gloo's presence, and several
processes run together under one deadline (all killed if one hangs)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_available() -> bool:
    try:
        from jax._src.lib import _jax
    except ImportError:
        return False
    return hasattr(_jax, "make_gloo_tcp_collectives")


def run_processes(commands: list[list[str]], env: dict, timeout_s: float):
    """``(return codes, outputs)`` of ``commands`` run at once; fails the test, killing
    every process and showing their output tails, when they run past ``timeout_s``."""
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd in commands
    ]
    outputs, deadline = [], time.monotonic() + timeout_s
    try:
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                tails = [q.communicate()[0][-3000:] for q in procs]
                pytest.fail(f"past {timeout_s} s; output tails:\n" + "\n----\n".join(tails))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outputs


GLOO_UNAVAILABLE = 77  # a worker's exit code when gloo CPU collectives cannot be set up


def run_workers(worker: str, args: list[str], timeout_s: float, paths=(), n: int = 2) -> list[dict]:
    """The JSON reports (the line starting ``{"process"``) of ``python worker i port *args``
    run as ``n`` processes on 127.0.0.1, each without the tests' ``XLA_FLAGS`` and with
    ``paths`` first on ``PYTHONPATH``. Fails the test when one exits non-zero; skips it
    when all exit with ``GLOO_UNAVAILABLE``."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, env.get("PYTHONPATH")]))
    port = free_port()
    cmds = [[sys.executable, worker, str(i), str(port), *args] for i in range(n)]
    codes, outputs = run_processes(cmds, env, timeout_s)
    if all(c == GLOO_UNAVAILABLE for c in codes):
        pytest.skip("gloo CPU collectives are unavailable: " + outputs[0].strip()[-300:])
    reports = []
    for i, (code, out) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"process {i} exited {code}:\n{out[-4000:]}"
        line = next(ln for ln in out.splitlines() if ln.startswith('{"process"'))
        reports.append(json.loads(line))
    return reports
