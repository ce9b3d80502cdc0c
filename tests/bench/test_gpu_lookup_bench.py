"""bench/gpu_lookup.py on its tiny presets: Pallas (interpreted off GPU) and XLA within
their float64 bounds, modelled and per-id bytes, the HBM presets' sizes."""

import json

import gpu_lookup
import pytest
from specs import LookupSpec

REQUIRED = {"bench", "impl", "pass", "T", "E", "D", "B", "L", "alpha", "weighted", "dtype"}
REQUIRED |= {"device_kind", "jax_version", "median_ms", "copy_gbps_ceiling"}
REQUIRED |= {"modelled_bytes", "gbps", "fraction_of_copy"}
REQUIRED |= {"per_id_bytes", "per_id_gbps", "per_id_fraction_of_copy"}
REQUIRED |= {"ids", "unique_rows", "bags", "max_dups", "table_init"}


def test_tiny_presets_run_and_agree(capsys):
    # fp32 Zipf ids with weights; fp16 MEAN (subnormal table values: rounding near zero)
    argv = ["--preset", "tiny_weighted,tiny_mean_fp16", "--reps", "1", "--warmup", "1"]
    # (row-wise Adagrad's float64 maths are tested in test_exact_reference)
    argv += ["--impl", "pallas,xla,torch", "--optimizer", "sgd,adam"]
    assert gpu_lookup.main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0]["pass"] == "copy" and lines[0]["gbps"] > 0
    timed = [x for x in lines if "median_ms" in x]
    assert {(x["impl"], x["pass"], x.get("optimizer")) for x in timed} == {
        (i, p, o)
        for i in ("pallas", "xla")
        for p, o in [("fwd", None), ("seq", None)] + [("bwd_update", o) for o in ("sgd", "adam")]
    }
    assert all(set(x) >= REQUIRED for x in timed)
    assert {(x["dtype"], x["pooling"]) for x in timed} == {("fp32", "SUM"), ("fp16", "MEAN")}
    for x in timed:
        spec = LookupSpec(**{k: x[k] for k in LookupSpec(T=1, E=1, D=1, B=1, L=1).as_dict()})
        opt = gpu_lookup.optimizer(x["optimizer"]) if "optimizer" in x else None
        want = gpu_lookup.modelled_bytes(spec, x["pass"], x["unique_rows"], opt)
        assert x["modelled_bytes"] == want
        assert x["per_id_bytes"] == gpu_lookup.per_id_bytes(spec, x["pass"], opt)
    checks = [x for x in lines if "within_bound" in x and "agree" not in x]
    # per preset: fwd, seq (pallas, xla) + table and state fields per optimizer and impl
    assert len(checks) == 2 * (2 * 2 + 2 * (1 + 3))
    assert all(x["within_bound"] and x["within_prob_bound"] for x in checks)
    assert all(x["max_bound"] > 0 for x in checks if x["pass"] != "seq")
    agree = [x for x in lines if "agree" in x]
    assert len(agree) == 8 and all(x["agree"] and x["ok"] for x in agree)  # 2 x (2 + 2)
    assert any(x.get("skipped") for x in lines if x.get("impl") == "torch") or any(
        x["impl"] == "torch" for x in timed
    )


def test_old_schedule_is_skipped_without_piece_len(capsys, monkeypatch):
    """``pallas_per_run`` needs ``fused_backward_update(..., piece_len=None)``: where the
    kernel has no such keyword, a ``skipped`` line (never run here, on CPU)."""
    monkeypatch.setattr(gpu_lookup, "PIECE_LEN", None)
    argv = ["--preset", "tiny", "--reps", "1", "--warmup", "0", "--impl", "pallas_per_run,xla"]
    assert gpu_lookup.main(argv + ["--pass", "bwd_update", "--optimizer", "sgd"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert any(x.get("impl") == "pallas_per_run" and "piece_len" in x["skipped"] for x in lines)
    assert {x["impl"] for x in lines if "median_ms" in x} == {"xla"}


def test_presets_and_bytes():
    presets = gpu_lookup.all_presets()
    target = presets["target"][0]
    assert (target.T, target.E, target.D, target.B, target.L) == (8, 1_000_000, 128, 65_536, 20)
    assert [s.alpha for s in presets["target_zipf"]] == [1.15]
    assert len(presets["gpu_sweep"]) > 5 and "tiny" in presets
    for name in ("hbm", "hbm_check", "hbm_large"):
        for s in presets[name]:
            assert s.T >= 2 and 10_000_000 <= s.E <= 100_000_000 and s.D == 128
            assert s.dtype == "fp32" and s.T * s.E * s.D * 4 > 100 * 50e6  # 100x the L2
    assert {s.alpha for s in presets["hbm"]} == {0.0, 0.8, 1.05, 1.2}
    assert {s.alpha for s in presets["hbm_check"]} <= {s.alpha for s in presets["hbm"]}

    spec = LookupSpec(T=2, E=10, D=8, B=4, L=3, dtype="fp16")
    ids, bags = 2 * 4 * 3, 2 * 4
    adagrad = gpu_lookup.optimizer("rowwise_adagrad")
    assert gpu_lookup.per_id_bytes(spec, "fwd") == ids * 8 * 2
    # rowwise Adagrad: f32 grad row + fp16 row read and written + one f32 accumulator r/w
    assert gpu_lookup.per_id_bytes(spec, "bwd_update", adagrad) == ids * (4 * 8 + 2 * 8 * 2 + 8)
    # 5 unique rows: ids + offsets + rows once + f32 output; output grad + id arrays + rows r/w
    assert gpu_lookup.modelled_bytes(spec, "fwd", 5) == 4 * ids + 4 * (bags + 1) + 5 * 16 + 4 * 64
    assert gpu_lookup.modelled_bytes(spec, "seq", 5) == 5 * ids + 5 * 16 + ids * 16
    adam = gpu_lookup.optimizer("adam")
    assert gpu_lookup.modelled_bytes(spec, "bwd_update", 5, adam) == (
        4 * bags * 8 + 13 * ids + 2 * 5 * (16 + 2 * 8 * 4)
    )
    with pytest.raises(ValueError, match="unknown impls"):
        gpu_lookup.run(spec, ("cuda",), ceiling=1.0)


def test_hbm_presets_fit_an_h200():
    """The memory arithmetic by ``_HBM``: every optimizer fits JAX's default pool on an
    H200 (75% of ~139 GiB) at ``hbm``; Adam does not at ``hbm_large`` (skipped there)."""
    pool = 0.75 * 139 * 2**30
    for s in gpu_lookup.GPU_PRESETS["hbm"]:
        for name in gpu_lookup.OPTIMIZERS:
            need = gpu_lookup.peak_bytes(s, gpu_lookup.optimizer(name), s.B * s.T * s.L)
            assert need < 0.95 * pool, (name, need / 2**30)
    large = gpu_lookup.GPU_PRESETS["hbm_large"][0]
    for name, fits in (("sgd", True), ("rowwise_adagrad", True), ("adam", False)):
        need = gpu_lookup.peak_bytes(large, gpu_lookup.optimizer(name), large.B * large.T * large.L)
        assert (need < 0.95 * pool) is fits, (name, need / 2**30)
