"""``bench/compare_torchrec.py --preset tiny`` as a smoke test: both frameworks agree."""

import json

import compare_torchrec
import pytest


# fbgemm_gpu's deprecated-module warnings, raised while DMP builds its fused kernel.
@pytest.mark.filterwarnings("ignore::DeprecationWarning:fbgemm_gpu.*")
def test_tiny_preset_runs_and_agrees(capsys):
    pytest.importorskip("torchrec")
    argv = ["--preset", "tiny", "--reps", "2", "--warmup", "1"]
    assert compare_torchrec.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ratios = [r for r in lines if r["impl"] == "ratio"]
    phases = {"forward", "train_rowwise_adagrad", "train_sgd"}
    assert {(r["config"], r["phase"]) for r in ratios} == {
        (c, p) for c in ("tiny", "tiny_zipf") for p in phases
    }
    for r in ratios:
        assert r["agree"] and r["ratio_jaxrec_over_torchrec"] > 0 and r["goal"] in (1.2, 1.5)
    runs = [r for r in lines if r["impl"] in ("jaxrec", "torchrec")]
    assert len(runs) == 2 * len(ratios)
    assert all(r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in runs)
