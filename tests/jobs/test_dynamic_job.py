"""``jaxrec-train-dlrm --dynamic-tables``: every table keyed by the raw id, sharded by its
hash over 8 CPU devices, checkpointed, resumed on 4 devices."""

import json
import os
import subprocess
import sys

import pytest

from jaxrec.jobs.train_dlrm import main

CODE = "import sys; from jaxrec.jobs.train_dlrm import main; sys.exit(main(sys.argv[1:]))"
COMMON = [
    "--num-train",
    "4096",
    "--num-eval",
    "512",
    "--batch-size",
    "32",
    "--quiet",
    "--dynamic-tables",
    "2048",
    "--dynamic-admission",
    "2",
    "--dynamic-eviction",
    "lfu",
]


def _run(argv):
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_cpu_collective_call_terminate_timeout_seconds=60"
    return subprocess.run(
        [sys.executable, "-c", CODE, *argv], env=env, capture_output=True, text=True, timeout=900
    )


def test_dynamic_tables_train_sharded_and_resume_on_fewer_devices(tmp_path):
    run_dir = tmp_path / "run"
    first = _run(
        [
            *COMMON,
            "--devices",
            "8",
            "--max-steps",
            "6",
            "--checkpoint-every",
            "3",
            "--run-dir",
            str(run_dir),
        ]
    )
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["devices"] == 8 and summary["sharding"] == "row_wise"
    tables = summary["dynamic_tables"]
    assert len(tables) == 26
    for c in tables.values():
        assert 0 < c["occupancy"] <= 2048 and min(c.values()) >= 0
    # Frequency admission: ids seen once are rejected, so some table rejected ids.
    assert any(c["rejected"] > 0 for c in tables.values())
    again = _run(
        [*COMMON, "--devices", "4", "--max-steps", "8", "--resume", "--run-dir", str(run_dir)]
    )
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["devices"] == 4 and resumed["steps"] == 8
    for t, c in resumed["dynamic_tables"].items():
        assert c["occupancy"] >= tables[t]["occupancy"]  # nothing lost on the way (no TTL)


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--dynamic-tables", "1000"], "multiple of --dynamic-ways"),
        (["--dynamic-tables", "1024", "--sharding", "table_wise"], "shard row-wise"),
        (["--dynamic-tables", "1024", "--cache-tables", "all"], "drop --cache-tables"),
    ],
)
def test_dynamic_flags_that_cannot_work_say_so(flags, match, tmp_path):
    with pytest.raises(SystemExit, match=match):
        main([*flags, "--run-dir", str(tmp_path / "r")])
