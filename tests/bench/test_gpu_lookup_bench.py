"""bench/gpu_lookup.py on its tiny presets: Pallas (interpreted off GPU) agrees with XLA."""

import json

import gpu_lookup
import pytest
from specs import LookupSpec

REQUIRED = {"bench", "impl", "pass", "T", "E", "D", "B", "L", "alpha", "weighted", "dtype"}
REQUIRED |= {"device_kind", "jax_version", "median_ms", "gbps", "bytes", "copy_gbps_ceiling"}
REQUIRED |= {"fraction_of_copy"}


def test_tiny_presets_run_and_agree(capsys):
    argv = ["--preset", "tiny,tiny_weighted", "--reps", "1", "--warmup", "1", "--dtype", "bf16"]
    assert gpu_lookup.main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0]["pass"] == "copy" and lines[0]["gbps"] > 0
    timed = [x for x in lines if "median_ms" in x]
    assert {(x["impl"], x["pass"]) for x in timed} == {
        (i, p) for i in ("pallas", "xla") for p in ("fwd", "bwd_update", "seq")
    }
    assert all(set(x) >= REQUIRED and x["dtype"] == "bf16" for x in timed)
    agree = [x for x in lines if "agree" in x]
    assert len(agree) == 6 and all(x["agree"] for x in agree)  # 2 presets x 3 passes
    assert any(x.get("skipped") for x in lines if x.get("impl") == "torch") or any(
        x["impl"] == "torch" for x in timed
    )


def test_presets_and_bytes():
    presets = gpu_lookup.all_presets()
    target = presets["target"][0]
    assert (target.T, target.E, target.D, target.B, target.L) == (8, 1_000_000, 128, 65_536, 20)
    assert len(presets["gpu_sweep"]) > 5 and "tiny" in presets
    spec = LookupSpec(T=2, E=10, D=8, B=4, L=3, dtype="fp16")
    ids = 2 * 4 * 3
    assert gpu_lookup.fwd_bytes(spec) == ids * 8 * 2
    # rowwise Adagrad: f32 grad row + fp16 row read and written + one f32 accumulator r/w
    opt = gpu_lookup.OPTIMIZERS["rowwise_adagrad"]()
    assert gpu_lookup.bwd_bytes(spec, opt) == ids * (4 * 8 + 2 * 8 * 2 + 2 * 4)
    with pytest.raises(ValueError, match="unknown impls"):
        gpu_lookup.run(spec, ("cuda",), ceiling=1.0)
