"""bench/pipeline.py at its tiny preset: every mode runs and reports, the ratios are consistent."""

import json

import pipeline


def test_pipeline_bench_tiny(capsys):
    assert pipeline.main(["--preset", "tiny", "--steps", "3", "--reps", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    modes = [r["impl"] for r in lines]
    assert modes == ["host_prep", "step_only", "sequential", "pipelined", "ratios"]
    med = {r["impl"]: r["median_ms"] for r in lines[:-1]}
    assert all(v > 0 for v in med.values())
    ratios = lines[-1]
    assert abs(ratios["sequential_over_pipelined"] - med["sequential"] / med["pipelined"]) < 1e-2


def test_pipeline_bench_compare_steps_tiny(capsys):
    args = ["--preset", "tiny", "--steps", "3", "--reps", "1", "--compare-steps"]
    assert pipeline.main(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["impl"] for x in lines] == ["sync", "sparse_dist", "semi_sync", "ratios"]
    med = {x["impl"]: x["median_ms"] for x in lines[:3]}
    assert abs(lines[3]["semi_sync_over_sync"] - med["semi_sync"] / med["sync"]) < 1e-2
