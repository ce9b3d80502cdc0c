"""``jaxrec-train-dlrm`` over 2 hosts (network namespaces), with a process killed.

Each process runs in its own network namespace (tests/hosts.py: its own eth0
and address on a bridge, the coordinator on host 0's address, gloo bound to
eth0), so nothing goes over a shared loopback. A process is SIGKILLed mid-run:
the other exits at once (jaxrec's watchdog: its connection to process 0 closes),
naming the lost process; ``--resume`` on both then ends where an uninterrupted one-process run
does (tables and metrics, to the tolerances of test_multihost_job.py). Killed
while its checkpoint save is in flight (process 0, the coordinator and the one
that commits), the step it was saving is not committed and the run resumes from
the one before.

The job runs as in test_multihost_job.py (tiny MovieLens file, data-parallel
tables, 2 processes x 4 CPU devices, 6 steps, a checkpoint every 2), with two
test hooks set from the environment by ``_LAUNCH``: a delay per batch (so a kill
lands mid-run) and a pause in one save.
"""

import json
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from hosts import Processes, base_env, network_hosts
from test_multihost_job import _ratings

import jaxrec
from jaxrec.jobs.from_run import model_from_run
from jaxrec.jobs.train_dlrm import PEER_LOST, main

ROOT = str(Path(jaxrec.__file__).resolve().parents[1])
HEARTBEAT_S = 10  # --heartbeat-timeout: a survivor waiting outside a collective ends by then
EXIT_BOUND_S = 60  # how long after the kill every other process must have exited
RUN_S = 240  # one run of both processes, compiles included (2 busy cores)

# The job, with two hooks for the tests: TEST_BATCH_DELAY_S sleeps before each
# batch; TEST_PAUSE_SAVE=k holds this process's save of step k before it writes its
# index of the step (the last file a process adds before process 0 commits).
_LAUNCH = """
import os, sys, time
from jaxrec.checkpoint import manager
from jaxrec.jobs import train_dlrm

delay = float(os.environ.get("TEST_BATCH_DELAY_S", 0))
if delay:
    batches = train_dlrm._device_batches
    def slow(*args, **kwargs):
        for batch in batches(*args, **kwargs):
            time.sleep(delay)
            yield batch
    train_dlrm._device_batches = slow
pause = os.environ.get("TEST_PAUSE_SAVE")
if pause:
    write_json = manager.write_json
    def held(path, value, **kwargs):
        if f"{os.sep}{pause}.partial{os.sep}index{os.sep}" in path:
            print(f"[test] holding the save of step {pause}", flush=True)
            time.sleep(600)
        return write_json(path, value, **kwargs)
    manager.write_json = held
sys.exit(train_dlrm.main(sys.argv[1:]))
"""


def _flags(data: Path) -> list[str]:
    flags = ["--dataset", "movielens", "--data-dir", str(data), "--sharding", "data_parallel"]
    flags += ["--batch-size", "16", "--max-steps", "6", "--checkpoint-every", "2"]
    flags += ["--embedding-dim", "4", "--dense-arch", "8,4", "--over-arch", "8,1"]
    return flags + ["--keep-checkpoints", "4"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The data and the uninterrupted run: one process, 8 devices."""
    folder = tmp_path_factory.mktemp("faults")
    _ratings(folder / "ml")
    run = folder / "one"
    assert main([*_flags(folder / "ml"), "--quiet", "--devices", "8", "--run-dir", str(run)]) == 0
    return folder / "ml", run


@pytest.fixture
def hosts():
    with network_hosts(2) as hs:
        yield hs


def _start(hosts, flags: list[str], folder: Path, envs=({}, {})) -> Processes:
    """The job on every host (process i on host i; the coordinator on host 0)."""
    address = f"{hosts[0].address}:{12355}"
    env = base_env([ROOT], devices=4)
    env["GLOO_SOCKET_IFNAME"] = hosts[0].interface  # eth0 on every host
    cmds = [
        h.command([sys.executable, "-c", _LAUNCH, *flags, "--coordinator-address", address])
        + ["--num-processes", str(len(hosts)), "--process-id", str(i)]
        + ["--heartbeat-timeout", str(HEARTBEAT_S)]
        for i, h in enumerate(hosts)
    ]
    return Processes(cmds, [dict(env, **e) for e in envs], folder)


def _kill_and_wait(procs: Processes, victim: int) -> tuple[list[int], float]:
    """SIGKILLs process ``victim``; every return code, and how long after the kill
    the last process exited."""
    procs.procs[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    codes = procs.wait(EXIT_BOUND_S + 30)
    return codes, max(procs.ended) - killed


def _resume(hosts, flags, folder: Path) -> list[str]:
    procs = _start(hosts, [*flags, "--resume"], folder)
    codes = procs.wait(RUN_S)
    assert codes == [0, 0], procs.tails()
    outs = [procs.output(i) for i in range(2)]
    assert not any("Traceback" in out for out in outs), procs.tails()  # (watchdog included)
    return outs


def _assert_same_run(got: Path, want: Path) -> None:
    """Same steps, metrics and parameters as the one-process run (gloo sums in
    another order: the last float32 bit, as in test_multihost_job.py)."""
    g, w = (json.loads((p / "summary.json").read_text()) for p in (got, want))
    assert (g["processes"], g["devices"], g["steps"]) == (2, 8, w["steps"])
    for key, value in w["eval"].items():
        np.testing.assert_allclose(g["eval"][key], value, rtol=1e-6, err_msg=key)
    tables = 0
    for (name, a), (name_b, b) in zip(_leaves(want), _leaves(got), strict=True):
        assert name == name_b
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-8, err_msg=name)
        tables += "embedding_bag_collection" in name
    assert tables


def _leaves(run_dir: Path) -> list[tuple[str, np.ndarray]]:
    model, _ = model_from_run(run_dir)
    flat = jax.tree_util.tree_leaves_with_path(nnx.state(model))
    return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in flat]


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def _error_line(out: str) -> str:
    (line,) = [ln for ln in out.splitlines() if ln.startswith("jaxrec-train-dlrm: error:")]
    return line


def test_killed_process_stops_the_other_and_the_run_resumes(one_process, hosts, tmp_path):
    data, one = one_process
    run = tmp_path / "run"
    flags = [*_flags(data), "--run-dir", str(run)]
    procs = _start(hosts, flags, tmp_path / "first", envs=[{"TEST_BATCH_DELAY_S": "0.5"}] * 2)
    procs.wait_for(lambda: (run / "checkpoints" / "4").is_dir(), RUN_S, "step 4's checkpoint")
    codes, took = _kill_and_wait(procs, victim=1)

    out = procs.output(0)
    assert codes == [PEER_LOST, -signal.SIGKILL], procs.tails()
    assert took < EXIT_BOUND_S, took
    # one line naming the lost process and its host, and what to do; no traceback
    line = _error_line(out)
    assert f"process 1 ({hosts[1].address}) stopped responding" in line, line
    assert "--resume" in line and "Traceback" not in out, out[-3000:]
    assert "4" in _steps(run) and "6" not in _steps(run)

    out0, _ = _resume(hosts, flags, tmp_path / "resumed")
    assert "resumed from step 4" in out0, out0[-3000:]
    _assert_same_run(run, one)


def test_killed_during_a_save_resumes_from_the_step_before(one_process, hosts, tmp_path):
    data, one = one_process
    run = tmp_path / "run"
    flags = [*_flags(data), "--run-dir", str(run)]
    procs = _start(hosts, flags, tmp_path / "first", envs=[{"TEST_PAUSE_SAVE": "4"}, {}])
    procs.wait_for(lambda: "holding the save of step 4" in procs.output(0), RUN_S, "the save")
    codes, took = _kill_and_wait(procs, victim=0)  # the coordinator

    assert codes == [-signal.SIGKILL, PEER_LOST], procs.tails()
    assert took < EXIT_BOUND_S, took
    line = _error_line(procs.output(1))
    assert f"process 0 ({hosts[0].address}) stopped responding" in line, line
    # process 0 had written its shards of step 4, not its index: step 4 is not committed
    assert _steps(run) == ["2", "4.partial"], _steps(run)

    out0, _ = _resume(hosts, flags, tmp_path / "resumed")
    assert "resumed from step 2" in out0, out0[-3000:]
    assert "4.partial" not in _steps(run)  # (step 4 saved again: its partial replaced)
    _assert_same_run(run, one)
