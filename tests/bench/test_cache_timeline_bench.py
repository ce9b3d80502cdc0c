"""bench/cache_timeline.py (a traced cached pipeline, read back): the reading on
made-up events, and the tiny preset as a test."""

import json

import cache_timeline as ct
import pytest

from jaxrec.cache import native


def _op(module, run, ts, dur, op="op"):
    return {
        "ph": "X",
        "name": op,
        "ts": ts,
        "dur": dur,
        "args": {"hlo_module": module, "run_id": run, "hlo_op": op},
    }


def test_reading_made_up_events():
    events = [
        *(
            e
            for i in range(4)
            for e in (
                _op("jit__step", f"s{i}", 100 * i, 30, "ffi_call.1"),
                _op("jit__step", f"s{i}", 100 * i + 30, 20, "dot"),
            )
        ),
        *(_op("jit__move_inplace", f"m{i}", 100 * i + 60, 30) for i in range(4)),
        *(
            {"ph": "X", "name": "jaxrec.cache.prepare", "ts": 100 * i + 40, "dur": 20}
            for i in range(4)
        ),
    ]
    runs = ct.program_runs(events)
    assert [r[:2] for r in runs["jit__step"]] == [(100 * i, 100 * i + 50) for i in range(4)]
    assert runs["jit__step"][0][2] == {"ffi_call.1": 30, "dot": 20}
    s = ct.summarize(events, "jit__step", {"ffi_call.1": "jaxrec_update"})
    # inner steps 1, 2: one interval of 100 us; programs busy 80 of it; planning half
    # beside a step (40-50 of 40-60)
    assert s["steps"] == 1 and s["interval_ms"] == 0.1 and s["step_ms"] == 0.05
    assert s["step_ops_ms"] == {"jaxrec_update": 0.03, "dot": 0.02}
    assert s["load_ms"] == 0.03 and s["prepare_ms"] == 0.02
    assert s["programs_busy"] == 0.8 and s["prepare_beside_step"] == 0.5
    assert ct.overlap([(0, 10), (20, 30)], [(5, 25)]) == 10
    assert ct.union([(5, 8), (0, 6), (9, 10)]) == [(0, 8), (9, 10)]
    with pytest.raises(SystemExit, match="no op with an hlo_module"):
        ct.summarize([{"ph": "X", "name": "kernel", "ts": 0, "dur": 1}], "jit__step")
    with pytest.raises(SystemExit, match="trace more --steps"):
        ct.summarize(events[:4], "jit__step")
    text = '  %ffi_call.6 = (f32[2]) custom-call(%a), custom_call_target="jaxrec_kjt_embedding_bag"'
    assert ct.custom_call_targets(text) == {"ffi_call.6": "jaxrec_kjt_embedding_bag"}


def test_tiny_preset_records(capsys, tmp_path):
    argv = ["--preset", "tiny", "--steps", "8", "--warmup", "5", "--trace-dir", str(tmp_path)]
    assert ct.main(argv) == 0
    lines = {r["model"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(lines) == {"cached_waited", "cached", "all_device"}
    for r in lines.values():
        assert r["steps"] == 5 and r["step_ms"] > 0 and 0 < r["programs_busy"] <= 1
        if native.AVAILABLE:  # the custom calls by their targets
            assert "jaxrec_kjt_backward_update_rowwise_adagrad" in r["step_ops_ms"], r
    waited, piped = lines["cached_waited"], lines["cached"]
    assert waited["prepare_beside_step"] == 0.0  # planned before each step, never beside
    assert waited["load_ms"] > 0 and waited["prepare_ms"] > 0 and piped["prepare_ms"] > 0
    assert piped["interval_ratio"] > 0 and "prepare_ms" not in lines["all_device"]
    assert list(tmp_path.glob("cached/**/*.trace.json.gz"))  # kept for the perfetto UI
