"""bench/mc.py (managed-collision remap + lookup vs modulo hashing): tiny preset as a test."""

import json

import mc
import numpy as np
from specs import LookupSpec

import jaxrec as jr

REQUIRED = {
    "bench",
    "impl",
    "T",
    "E",
    "D",
    "B",
    "L",
    "alpha",
    "device_kind",
    "platform",
    "jax_version",
    "median_ms",
    "min_ms",
    "max_ms",
    "mean_ms",
    "ids_per_s",
    "collision_free_rate",
    "policy",
    "eviction_interval",
}


def test_tiny_preset_records_and_agreement(capsys):
    assert mc.main(["--preset", "tiny", "--reps", "2", "--warmup", "1", "--alpha", "1.1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    timed = [r for r in lines if "median_ms" in r]
    assert [r["impl"] for r in timed] == list(mc.IMPLS)
    for r in timed:
        assert set(r) >= REQUIRED, set(REQUIRED) - set(r)
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["ids_per_s"] > 0
        assert 0.0 <= r["collision_free_rate"] <= 1.0
    by_impl = {r["impl"]: r for r in timed}
    assert by_impl["mc_remap"]["outputs_agree"] and by_impl["mc_remap"]["max_abs_diff"] == 0.0
    assert by_impl["mc_train"]["collision_free_rate"] > 0.5  # warmed tables admit the hot ids
    ratios = [r for r in lines if "ratio_over_modulo" in r]
    assert [r["impl"] for r in ratios] == ["mc_remap", "mc_train", "remap_only"]


def test_raw_ids_and_modulo_collision_rate():
    spec = LookupSpec(T=2, E=10, D=4, B=3, L=2)
    kjts = mc.raw_batches(spec, 2, factor=4, drift=1, seed=0)
    assert len(kjts) == 2 and kjts[0].keys() == ["f0", "f1"]
    v = np.asarray(kjts[0].values())
    assert v.dtype == np.int32 and v.min() >= 0 and v.size == 12
    # ids 1, 11 share row 1; id 2 owns row 2; the repeated id 3 owns row 3.
    kjt = jr.KeyedJaggedTensor(
        ["f"], np.array([1, 11, 2, 3, 3, 21], np.int32), lengths=[2, 2, 2], capacities=[6]
    )
    assert mc.modulo_free_rate(kjt, 10) == 3 / 6
