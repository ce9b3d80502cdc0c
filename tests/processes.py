"""Launching test processes on 127.0.0.1: a free port, gloo's presence, and several
processes run together under one deadline (all killed if one hangs)."""

from __future__ import annotations

import socket
import subprocess
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
