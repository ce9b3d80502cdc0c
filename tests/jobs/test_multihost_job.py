"""``jaxrec-train-dlrm`` over 2 processes x 4 CPU devices equals 1 process x 8 devices.

The two processes (gloo collectives, coordinator on 127.0.0.1) share one run
directory: each reads its own devices' batches, checkpoints are written
together, and only process 0 writes reports. A tiny MovieLens file (two
tables) keeps the compiles short, and the tables are data-parallel: a row-wise
job costs about twice the compile time here, and tables sharded across
processes (and their checkpoints) have their own two-process tests
(tests/distributed/test_multiprocess.py, tests/checkpoint/).
"""

import json
import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from processes import free_port, run_processes

import jaxrec
from jaxrec.jobs.from_run import model_from_run
from jaxrec.jobs.train_dlrm import main

TIMEOUT_S = 240
ROOT = str(Path(jaxrec.__file__).resolve().parents[1])
CODE = "import sys; from jaxrec.jobs.train_dlrm import main; sys.exit(main(sys.argv[1:]))"


def _ratings(folder: Path, n: int = 1200, users: int = 40, items: int = 60) -> None:
    """An ml-20m style ratings.csv (user_id and item_id features, no dense)."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    users, items = rng.integers(1, users, n), rng.integers(1, items, n)
    stars = 1 + (users % 5 + items % 7) // 2  # learnable from the ids
    cols = (users, items, stars)
    rows = [
        f"{u},{i},{min(s, 5)}.0,{1000 + k}" for k, (u, i, s) in enumerate(zip(*cols, strict=True))
    ]
    (folder / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + "\n".join(rows))


def _run_two_processes(flags: list[str]) -> list[str]:
    """Both processes' output; fails the test (killing both) on a timeout or an exit != 0."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
    address = f"127.0.0.1:{free_port()}"
    cmds = [
        [sys.executable, "-c", CODE, *flags, "--coordinator-address", address]
        + ["--num-processes", "2", "--process-id", str(i)]
        for i in range(2)
    ]
    codes, outputs = run_processes(cmds, env, TIMEOUT_S)
    for i, (code, out) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"process {i} exited {code}:\n{out[-4000:]}"
    return outputs


def _leaves(run_dir: Path) -> list[tuple[str, np.ndarray]]:
    model, _ = model_from_run(run_dir)
    flat = jax.tree_util.tree_leaves_with_path(nnx.state(model))
    return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in flat]


def test_two_processes_equal_one_process(tmp_path):
    _ratings(tmp_path / "ml")
    flags = ["--dataset", "movielens", "--data-dir", str(tmp_path / "ml"), "--quiet"]
    flags += ["--sharding", "data_parallel", "--batch-size", "16", "--max-steps", "4"]
    flags += ["--embedding-dim", "4", "--dense-arch", "8,4", "--over-arch", "8,1"]
    flags += ["--tensorboard", "--plot"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main([*flags, "--devices", "8", "--run-dir", str(one)]) == 0
    # No --devices: a multi-process run takes every device (2 x 4).
    out0, out1 = _run_two_processes([*flags, "--run-dir", str(two)])

    want = json.loads((one / "summary.json").read_text())
    got = json.loads((two / "summary.json").read_text())
    assert (got["processes"], want["processes"], got["devices"]) == (2, 1, 8)
    for key in ("steps", "samples", "sharding", "skipped_steps"):
        assert got[key] == want[key], key
    # Only process 0 reports: one summary line, one metrics line per evaluation.
    assert '"processes": 2' in out0 and '"processes"' not in out1
    assert len((two / "metrics.jsonl").read_text().splitlines()) == 1
    assert len(list((two / "tb").iterdir())) == 1 and (two / "curves.png").is_file()
    assert [p.name for p in (two / "checkpoints").iterdir() if p.name.isdigit()] == ["4"]
    # Same batches per device, so the same steps: every parameter and table is equal.
    tables = 0
    # Dense gradients are also summed over the 8 devices: across processes gloo may add
    # them in another order, so parameters may differ in the last float32 bit (seen:
    # 1 ulp of one bias entry after 4 steps); a wrong batch split moves them by far more.
    for (name, a), (name_b, b) in zip(_leaves(one), _leaves(two), strict=True):
        assert name == name_b
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-8, err_msg=name)
        tables += "embedding_bag_collection" in name
    # The metric sums over the 8 devices cross the processes through gloo, which adds
    # them in another order than XLA:CPU in one process: NE and log loss may differ
    # in the last float32 bit (seen: 1 ulp), no more.
    for key, value in want["eval"].items():
        np.testing.assert_allclose(got["eval"][key], value, rtol=1e-6, err_msg=key)
    assert tables


def test_two_processes_with_cached_tables_equal_one_process(tmp_path):
    """Both tables row-wise in host memory, each process holding its own devices' rows
    (and planning them for both processes' ids), with a device cache of 60% of them:
    the same run as one process's."""
    _ratings(tmp_path / "ml", n=2400, users=400, items=600)
    flags = ["--dataset", "movielens", "--data-dir", str(tmp_path / "ml"), "--quiet"]
    flags += ["--sharding", "row_wise", "--batch-size", "16", "--max-steps", "6"]
    flags += ["--embedding-dim", "4", "--dense-arch", "8,4", "--over-arch", "8,1"]
    flags += ["--cache-tables", "all", "--cache-load-factor", "0.6", "--eval-every", "3"]
    one, two = tmp_path / "one", tmp_path / "two"
    # (the host's fully associative slot maps, as two processes plan: the same hit rates)
    assert main([*flags, "--devices", "8", "--cache-slot-maps", "host", "--run-dir", str(one)]) == 0
    _run_two_processes([*flags, "--run-dir", str(two)])

    want = json.loads((one / "summary.json").read_text())
    got = json.loads((two / "summary.json").read_text())
    assert (got["processes"], want["processes"], got["devices"]) == (2, 1, 8)
    assert got["steps"] == want["steps"] == 6
    assert sorted(got["cached_tables"]) == ["t_item_id", "t_user_id"]
    for name, c in want["cached_tables"].items():
        assert c["slots"] < c["rows"] and c["hit_rate"] < 1, (name, c)
    # each process counts its own shards' lookups: summed, they are one process's
    assert got["cached_tables"] == want["cached_tables"]
    evals = [(two / "metrics.jsonl"), (one / "metrics.jsonl")]
    got_e, want_e = ([json.loads(x) for x in p.read_text().splitlines()] for p in evals)
    assert [e["step"] for e in got_e] == [e["step"] for e in want_e] == [3, 6]
    for g, w in zip(got_e, want_e, strict=True):  # (gloo's sums: the last float32 bit)
        for key, value in w.items():
            np.testing.assert_allclose(g[key], value, rtol=1e-6, err_msg=key)
    # the checkpoint holds the logical tables, each process's rows written by it;
    # gloo's sums (the last float32 bit of the dense gradients) reach the rows through
    # six row-wise Adagrad steps: up to ~11 ulps seen on one row of 989
    tables = 0
    for (name, a), (name_b, b) in zip(_leaves(one), _leaves(two), strict=True):
        assert name == name_b
        np.testing.assert_allclose(b, a, rtol=2e-6, atol=1e-8, err_msg=name)
        tables += "embedding_bag_collection" in name
    assert tables


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--process-id", "1"], "--num-processes is required"),
        (["--num-processes", "2", "--process-id", "0"], "needs --coordinator-address"),
        (["--num-processes", "2", "--coordinator-address", "127.0.0.1:1"], "needs this process"),
        (["--num-processes", "2", "--process-id", "2", "--coordinator-address", "h:1"], "lie in"),
        (["--num-processes", "2", "--process-id", "0", "--coordinator-address", "h"], "host:port"),
        (["--num-processes", "2", "--process-id", "0", "--devices", "3"], "split evenly over 2"),
        (["--distributed", "off", "--num-processes", "2"], "--distributed off runs one"),
    ],
)
def test_bad_process_flags_fail_before_connecting(argv, message, monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    with pytest.raises(SystemExit, match=message):
        main([*argv, "--run-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()
