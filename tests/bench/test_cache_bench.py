"""bench/cache.py (host tables with a device row cache vs all-device): tiny preset as a test."""

import json

import cache


def test_tiny_preset_records(capsys):
    assert cache.main(["--preset", "tiny", "--reps", "2", "--policy-rows", "20000"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["copy"]["host_gather_GBps"] > 0 and lines[0]["cpu"]
    cases = {(r["alpha"], r["load_factor"]): r for r in lines if "cached_step_ms" in r}
    assert set(cases) == {(a, lf) for a in ("uniform", 1.05) for lf in (0.1, 1.0)}
    for r in cases.values():
        assert 0.0 <= r["row_hit_rate"] <= r["hit_rate"] <= 1.0  # a row's repeats hit
        assert r["cached_over_device"] > 0 and r["rows_in_per_step"] >= r["rows_out_per_step"] >= 0
    # skewed ids hit more than uniform ones, and a bigger cache no less than a small one
    assert cases[(1.05, 0.1)]["hit_rate"] > cases[("uniform", 0.1)]["hit_rate"]
    assert cases[(1.05, 1.0)]["hit_rate"] >= cases[(1.05, 0.1)]["hit_rate"]
    assert cases[("uniform", 1.0)]["hit_rate"] > cases[("uniform", 0.1)]["hit_rate"]
    policy = [r for r in lines if r.get("policy_only")]
    assert {r["algorithm"] for r in policy} == {"lru", "lfu"}
    assert all(0.0 < r["hit_rate"] < 1.0 for r in policy)
