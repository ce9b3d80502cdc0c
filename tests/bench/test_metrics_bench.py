"""bench/metrics.py on a small batch: every metric runs and agrees with numpy."""

import json

import metrics as metrics_bench


def test_small_run_records_and_agreement(capsys):
    assert metrics_bench.main(["--samples", "3000", "--reps", "1", "--warmup", "0"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["metric"] for r in lines] == [c[0] for c in metrics_bench.CASES]
    for r in lines:
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["samples_per_s"] > 0
        assert r["cpu"] and r["samples"] == 3000
        if "ratio" in r:
            assert r["agree"], r
