"""bench/dlrm_movielens.py on its synthetic-tiny data: both frameworks train, evaluate
and agree (shared initial weights), in a subprocess as the script is run.

The script's parameter ``check`` (one more process, ~8 s) is left out to stay
under 30 s; with shared weights the two runs' AUCs must still agree closely."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "dlrm_movielens.py")


def test_dlrm_movielens_synthetic_tiny():
    pytest.importorskip("torch", reason="the TorchRec side needs torch")
    pytest.importorskip("torchrec", reason="the TorchRec side needs torchrec")
    argv = ["--synthetic-tiny", "--epochs", "1", "--batch-size", "128", "--check-steps", "0"]
    out = subprocess.run(
        [sys.executable, SCRIPT, *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert [r["framework"] for r in lines] == ["jaxrec", "torchrec", "summary"]
    *runs, summary = lines
    for r in runs:
        assert r["epoch"] == 1 and r["dataset"] == "synthetic_tiny"
        assert 0 < r["test_auc"] <= 1 and r["test_ne"] > 0 and r["train_samples_per_s"] > 0
    assert summary["jaxrec_test_auc"] == runs[0]["test_auc"]
    assert summary["torchrec_test_auc"] == runs[1]["test_auc"]
    assert abs(summary["auc_diff_jaxrec_minus_torchrec"]) < 1e-3
