"""bench/cache.py (host tables with a device row cache vs all-device): tiny preset as a test."""

import json

import cache

import jaxrec.cache as jc
from jaxrec.cache import native


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
    # LRU as Che's approximation predicts; no policy above the most frequent rows held
    lru = next(r for r in policy if r["algorithm"] == "lru")
    assert abs(lru["hit_rate"] - lru["lru_che"]) < 0.01, lru
    assert all(r["hit_rate"] <= r["top_rows"] + 0.01 for r in policy)


def test_steady_state_flags(capsys):
    """``--algorithm lfu --warmup N``: the cases run LFU after N fresh warm-up steps,
    and the raw copies of the moved rows are timed beside them."""
    argv = [
        "--preset",
        "tiny",
        "--reps",
        "2",
        "--alphas",
        "1.05",
        "--load-factors",
        "0.1",
        "--algorithm",
        "lfu",
        "--warmup",
        "6",
    ]
    assert cache.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (case,) = [r for r in lines if "cached_step_ms" in r]
    assert case["config"]["algorithm"] == "lfu" and case["config"]["warmup"] == 6
    assert case["rows_in_per_step"] > 0
    assert case["move_floor_ms"] > 0 if native.AVAILABLE else case["move_floor_ms"] is None


def test_staged_flag(capsys, monkeypatch):
    """``--staged``: the moves go through pinned host staging, as off the CPU."""
    made, real = [], jc.RowCache
    monkeypatch.setattr(jc, "RowCache", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    argv = [
        "--preset",
        "tiny",
        "--reps",
        "2",
        "--alphas",
        "1.05",
        "--load-factors",
        "0.1",
        "--staged",
    ]
    assert cache.main(argv) == 0
    assert made and all(c._mover.paths == jc.MovePaths(inplace=False, pinned=True) for c in made)
    assert not any(c._mover.inplace for c in made)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (case,) = [r for r in lines if "cached_step_ms" in r]
    assert case["staged"] is True and case["rows_in_per_step"] > 0


def test_cache_model_against_simulation():
    """bench/cache_model.py's figures against a direct count on a small law: the most
    frequent rows' share summed rank by rank, and Che's LRU against a per-request LRU
    simulated over independent draws (its stated accuracy)."""
    from collections import OrderedDict

    import numpy as np
    from cache_model import lru_hit_rate, top_rows_hit_rate

    rows, slots, alpha = 2000, 200, 1.05
    p = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    assert abs(top_rows_hit_rate(rows, slots, alpha) - p[:slots].sum()) < 1e-12
    rng = np.random.default_rng(0)
    lru, hits, n = OrderedDict(), 0, 300_000
    for i, r in enumerate(rng.choice(rows, size=n, p=p)):
        if r in lru:
            lru.move_to_end(r)
            hits += i >= n // 3
        else:
            lru[r] = True
            if len(lru) > slots:
                lru.popitem(last=False)
    assert abs(hits / (n - n // 3) - lru_hit_rate(rows, slots, alpha)) < 0.005
    big = np.arange(1, 10_000_001, dtype=np.float64) ** -alpha  # past the exact ranks: bins
    exact = big[:2_000_000].sum() / big.sum()
    assert abs(top_rows_hit_rate(len(big), 2_000_000, alpha) - exact) < 1e-4


def test_host_scaling_and_slot_maps(capsys):
    """``--host-scaling``: per slot maps and scale, the misses stay as built while the ids
    double, with host CPU, process CPU, wall times and bytes moved; the copy line has
    the pinned rates (or a reason for their absence)."""
    argv = [
        "--preset",
        "tiny",
        "--host-scaling",
        "--hs-ids",
        "320",
        "--hs-misses",
        "32",
        "--hs-scales",
        "1,2",
        "--reps",
        "2",
    ]
    assert cache.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    copy = lines[0]["copy"]
    assert (copy["pinned_host_to_device_GBps"] is None) == (copy["pinned_reason"] is not None)
    rows = {(r["slot_maps"], r["scale"]): r for r in lines if r.get("host_scaling")}
    assert set(rows) == {(sm, s) for sm in ("device", "host") for s in (1, 2)}
    for (_, s), r in rows.items():
        assert r["misses_as_built"] and r["misses_per_step"] == 32 * 2  # two tables
        assert r["ids_per_step"] == 320 * s * 2 and r["evictions_per_step"] > 0
        assert r["host_cpu_ms"] > 0 and r["wall_ms"] > 0
        assert r["moved_MB_per_step"] > 0 and r["row_bytes"] == {"t0": 68, "t1": 68}


def test_slot_maps_flag(capsys):
    """``--slot-maps host``: the cases run the host planner and say so, with bytes moved."""
    argv = [
        "--preset",
        "tiny",
        "--reps",
        "2",
        "--alphas",
        "1.05",
        "--load-factors",
        "0.1",
        "--slot-maps",
        "host",
    ]
    assert cache.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (case,) = [r for r in lines if "cached_step_ms" in r]
    assert case["slot_maps"] == "host" and case["moved_MB_per_step"] > 0
    assert case["moved_GBps_at_cached_step"] > 0
