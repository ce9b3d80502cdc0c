"""A save that returned is on disk however the process ends short of being killed; a kill
mid-save leaves no step that ``resume`` would pick (``exit_worker.py`` is the process)."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from checkpoint_cases import leaves
from processes import run_processes
from test_checkpoint_manager import OPT, bumped, init

from jaxrec import checkpoint as ckpt

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "exit_worker.py")
TIMEOUT_S = 120


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    paths = [
        HERE,
        os.path.join(HERE, "..", "distributed"),
        os.path.join(HERE, ".."),
        env.get("PYTHONPATH"),
    ]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return env


def _assert_restores(directory, step, k):
    graphdef, state = init(dropout=False)
    with ckpt.CheckpointManager(directory) as mgr:
        restored, got = mgr.resume(graphdef, OPT, state)
    assert got == step
    for x, y in zip(leaves(restored), leaves(bumped(state, k)), strict=True):
        np.testing.assert_array_equal(x, y)


EXITS = {"return": 0, "raise": 1, "exit": 3}


@pytest.fixture(scope="module")
def exited(tmp_path_factory):
    """``mode -> (exit code, output, directory)``: one worker per mode, run at once (each
    mostly imports JAX and waits on its slowed write, so together they take one's time)."""
    dirs = {mode: tmp_path_factory.mktemp(mode) for mode in EXITS}
    cmds = [[sys.executable, WORKER, str(dirs[mode]), mode] for mode in EXITS]
    codes, outputs = run_processes(cmds, _env(), TIMEOUT_S)
    return {m: (c, out, dirs[m]) for m, c, out in zip(EXITS, codes, outputs, strict=True)}


@pytest.mark.parametrize("mode, code", EXITS.items())
def test_a_returned_save_survives_the_exit(exited, mode, code):
    got, output, directory = exited[mode]
    assert got == code, output[-3000:]
    assert "pending=True" in output, output[-3000:]  # the write was still running
    assert sorted(os.listdir(directory)) == ["1"]
    _assert_restores(directory, 1, 5)


def test_a_kill_mid_save_leaves_the_previous_step(tmp_path):
    cmd = [sys.executable, WORKER, str(tmp_path), "kill"]
    proc = subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "saving":
                break
        else:
            pytest.fail("the worker ended before saving step 2:\n" + "".join(lines)[-3000:])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert sorted(os.listdir(tmp_path)) == ["1", "2.partial"]
    _assert_restores(tmp_path, 1, 5)
    graphdef, state = init(dropout=False)
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:  # step 2 again: a clean write
        assert mgr.save(2, graphdef, OPT, bumped(state, 6))
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]
    _assert_restores(tmp_path, 2, 6)
