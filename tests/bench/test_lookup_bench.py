"""The lookup benchmark's small presets, run as correctness tests (TorchRec parity)."""

import dataclasses
import json

import lookup
import numpy as np
import pytest
from specs import PRESETS, LookupSpec, make_inputs

TINY = [name for name in PRESETS if name.startswith("tiny")]
REQUIRED = {
    "bench",
    "impl",
    "T",
    "E",
    "D",
    "B",
    "L",
    "alpha",
    "weighted",
    "dtype",
    "pooling",
    "device_kind",
    "platform",
    "jax_version",
    "median_ms",
    "min_ms",
    "max_ms",
    "gbps",
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_inputs_follow_the_spec(name):
    spec = dataclasses.replace(PRESETS[name], B=min(PRESETS[name].B, 64))  # cheap
    a, b = make_inputs(spec, seed=3), make_inputs(spec, seed=3)
    n = spec.T * spec.B * spec.L
    assert a["keys"] == [f"f{t}" for t in range(spec.T)]
    assert a["values"].shape == (n,) and a["lengths"].shape == (spec.T * spec.B,)
    assert (a["lengths"] == spec.L).all()
    assert a["values"].min() >= 0 and a["values"].max() < spec.E
    assert (a["weights"] is None) == (not spec.weighted)
    np.testing.assert_array_equal(a["values"], b["values"])  # deterministic


def test_zipf_is_skewed_and_uniform_is_not():
    def top_share(alpha):
        spec = LookupSpec(T=1, E=10_000, D=4, B=1000, L=20, alpha=alpha)
        counts = np.bincount(make_inputs(spec)["values"], minlength=spec.E)
        return counts.max() / counts.sum()

    assert top_share(0.0) < 0.002
    assert top_share(1.2) > 0.05


def test_spec_rejects_bad_fields():
    with pytest.raises(ValueError, match="dtype"):
        LookupSpec(T=1, E=1, D=1, B=1, L=1, dtype="fp64")
    with pytest.raises(ValueError, match="E must be"):
        LookupSpec(T=1, E=0, D=1, B=1, L=1)


def test_record_has_the_required_fields(capsys):
    assert lookup.main(["--preset", "tiny", "--reps", "2", "--warmup", "1", "--impl", "xla"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 1
    assert set(lines[0]) >= REQUIRED
    assert lines[0]["impl"] == "xla" and lines[0]["min_ms"] <= lines[0]["median_ms"]


@pytest.mark.parametrize("name", TINY)
def test_jaxrec_matches_torchrec(name):
    pytest.importorskip("torchrec")
    records = lookup.run(PRESETS[name], ("xla", "torchrec"), reps=2, warmup=1)
    impls = [r["impl"] for r in records]
    assert impls == ["xla", "torchrec", "xla"]
    assert set(records[1]) >= REQUIRED
    ratio = records[2]
    assert ratio["outputs_agree"], ratio
    assert ratio["max_abs_diff"] <= ratio["tolerance"]
    assert ratio["ratio_jaxrec_over_torchrec"] > 0
