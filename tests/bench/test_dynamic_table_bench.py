"""bench/dynamic_table.py (HashZch dynamic table vs a plain table): tiny preset as a test."""

import json

import dynamic_table
import numpy as np

TIMED = {
    "bench",
    "impl",
    "kind",
    "T",
    "E",
    "D",
    "B",
    "L",
    "alpha",
    "cpu",
    "machine",
    "median_ms",
    "min_ms",
    "max_ms",
    "mean_ms",
    "ids_per_s",
    "ways",
    "universe",
    "drift",
}
ARGV = [
    "--preset",
    "tiny",
    "--reps",
    "2",
    "--warmup",
    "1",
    "--fill-steps",
    "20",
    "--occ-steps",
    "12",
    "--occ-every",
    "4",
    "--breakdown",
]


def test_tiny_preset_records(capsys):
    assert dynamic_table.main(ARGV) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    kinds = {}
    for r in lines:
        assert r["bench"] == dynamic_table.BENCH and "error" not in r
        kinds.setdefault(r["kind"], []).append(r)
    assert set(kinds) == {
        "memory",
        "forward",
        "forward_ratio",
        "breakdown",
        "train_step",
        "train_step_ratio",
        "occupancy",
    }

    (mem,) = kinds["memory"]
    assert (
        mem["no_admission"]["matches_documented"]
        and mem["frequency_admission"]["matches_documented"]
    )
    assert mem["no_admission"]["slot_array_bytes_per_slot"] == 16
    assert 0 < mem["no_admission"]["share_of_fp32_row"] < 1

    for kind in ("forward", "breakdown", "train_step"):
        for r in kinds[kind]:
            assert set(r) >= TIMED, TIMED - set(r)
            assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["ids_per_s"] > 0
    fwd = {r["impl"]: r for r in kinds["forward"]}
    assert list(fwd) == list(dynamic_table.IMPLS)
    assert fwd["dynamic_eval"]["outputs_agree"] and 0 <= fwd["dynamic_eval"]["hit_rate"] <= 1
    train = fwd["dynamic_train_forward"]
    assert 0 < train["occupancy"] <= 1 and train["last_call"]["occupancy"] <= 2 * 1024
    assert [r["impl"] for r in kinds["forward_ratio"]] == ["dynamic_eval", "dynamic_train_forward"]
    assert [r["impl"] for r in kinds["train_step"]] == ["plain", "dynamic"]
    for r in kinds["forward_ratio"] + kinds["train_step_ratio"]:
        assert r["ratio_over_plain"] > 0

    occ = {r["policy"]: r for r in kinds["occupancy"]}
    assert list(occ) == list(dynamic_table.POLICIES)
    for r in occ.values():
        assert 0 < r["final_occupancy"] <= r["slots"]
        # every admission fills a free slot or evicts an id: occupancy = admitted - evicted
        assert r["final_occupancy"] == r["admitted_total"] - r["evicted_total"]
        assert 0 <= r["hit_rate_second_half"] <= r["served_rate_second_half"] <= 1
        s = r["series"]
        assert s["call"] == [4, 8, 12] and all(o <= r["slots"] for o in s["occupancy"])
        assert np.all(np.diff(s["occupancy"]) >= 0)  # nothing frees a slot
    assert occ["lru"]["rejected_total"] <= occ["lru_freq2"]["rejected_total"]


def test_stream_is_64_bit_and_drifts():
    stream = dynamic_table.Stream(slots=100, alpha=1.1, factor=4, drift=10, seed=0)
    a, b = stream.raw(0, 2, 50), stream.raw(1, 2, 50)
    assert a.dtype == np.uint64 and a.shape == (100,)
    assert np.all(a >> np.uint64(32) > 0)  # high words set
    assert np.array_equal(a, stream.raw(0, 2, 50))  # deterministic per step
    assert len(set(b.tolist()) - set(a.tolist())) > 0  # new ids every step
    assert not set(a[:50].tolist()) & set(a[50:].tolist())  # tables draw different ids
