"""``bench/compare_torchrec.py --preset tiny`` as a smoke test: both frameworks agree."""

import json

import compare_torchrec
import pytest


# fbgemm_gpu's deprecated-module warnings, raised while DMP builds its fused kernel.
@pytest.mark.filterwarnings("ignore::DeprecationWarning:fbgemm_gpu.*")
def test_tiny_preset_runs_and_agrees(capsys):
    pytest.importorskip("torchrec")
    argv = ["--preset", "tiny", "--reps", "2", "--warmup", "1", "--evict-mb", "4"]
    assert compare_torchrec.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ratios = [r for r in lines if r["impl"] == "ratio"]
    phases = {"forward", "train_rowwise_adagrad", "train_sgd"}
    assert {(r["config"], r["phase"]) for r in ratios} == {
        (c, p) for c in ("tiny", "tiny_zipf") for p in phases
    }
    for r in ratios:
        assert r["agree"] and r["ratio_jaxrec_over_torchrec"] > 0 and r["goal"] in (1.2, 1.3)
        # the roofline: each framework as a fraction of this run's ceilings
        assert r["gather_gbps"] > 0 and r["jaxrec_fraction_of_gather"] > 0
        assert r["gather_pool_gbps"] > 0 and r["jaxrec_fraction_of_gather_pool"] > 0
        assert r["evict_mb"] == 4
        assert r["torchrec_fraction_of_read"] >= 0  # tiny calls: rounds to 0
    ceilings = {(r["config"], r["ceiling"]) for r in lines if r["impl"] == "ceiling"}
    n = compare_torchrec.threads()
    assert ceilings == {
        (c, f"{k}_{t}t")
        for c in ("tiny", "tiny_zipf")
        for k in ("gather", "gather_pool", "read")
        for t in {1, n}
    }
    assert all(r["machine"]["cores"] >= 1 and "loadavg_1m" in r for r in lines)
    runs = [r for r in lines if r["impl"] in ("jaxrec", "torchrec")]
    assert len(runs) == 2 * len(ratios)
    assert all(r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in runs)
