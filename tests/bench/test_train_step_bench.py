"""The train-step benchmark's tiny presets as correctness tests: after one step,
jaxrec's table equals dense autodiff's and (where importable) TorchRec's."""

import dataclasses
import json

import numpy as np
import pytest
import train_step
from specs import PRESETS

FAST = train_step.Config(reps=2, warmup=0)
REQUIRED = {
    *("bench", "impl", "T", "E", "D", "B", "L", "alpha", "weighted", "dtype", "pooling"),
    *("device_kind", "platform", "jax_version", "median_ms", "min_ms", "max_ms", "optimizer"),
}


def check(records, impls):
    assert [r["impl"] for r in records] == [*impls, "ratios"]
    *runs, ratios = records
    for r in runs:
        assert set(r) >= REQUIRED and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    for r in runs[1:]:
        assert r["untouched_rows_changed"] == 0
        assert r["max_abs_diff_vs_jaxrec"] <= ratios["tolerance"]
        assert ratios[f"jaxrec_speedup_over_{r['impl']}"] > 0
    assert ratios["tables_agree"]


@pytest.mark.parametrize("optimizer", sorted(train_step.OPTIMIZERS))
def test_jaxrec_matches_dense(optimizer):
    cfg = dataclasses.replace(FAST, optimizer=optimizer)
    check(train_step.run(PRESETS["tiny"], ("jaxrec", "dense"), cfg), ["jaxrec", "dense"])


def test_main_weighted_zipf(capsys):
    argv = ["--preset", "tiny_weighted", "--reps", "2", "--warmup", "0", "--impl", "jaxrec,dense"]
    assert train_step.main(argv) == 0
    check([json.loads(line) for line in capsys.readouterr().out.splitlines()], ["jaxrec", "dense"])


def test_check_sees_wrong_rows():
    touched = [np.array([1, 3])]
    w = np.arange(20, dtype=np.float32).reshape(5, 4)
    ref = train_step.snapshot([w], touched)
    bad = w.copy()
    bad[0, 0] += 1  # an untouched row changed
    bad[3, 2] += 0.5  # a touched row off by 0.5
    assert train_step.compare(ref, train_step.snapshot([bad], touched), touched) == {
        "max_abs_diff_vs_jaxrec": 0.5,
        "untouched_rows_changed": 1,
    }


# fbgemm_gpu's deprecated-module warnings, raised while DMP builds its fused kernel.
@pytest.mark.filterwarnings("ignore::DeprecationWarning:fbgemm_gpu.*")
def test_jaxrec_matches_torchrec():
    pytest.importorskip("torchrec")
    check(train_step.run(PRESETS["tiny"], ("jaxrec", "torchrec"), FAST), ["jaxrec", "torchrec"])
