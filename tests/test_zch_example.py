"""examples/zch.py (managed collision on a drifting id stream) with tiny arguments."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).parents[1]
TINY = [
    "--steps",
    "30",
    "--batch",
    "32",
    "--zch-size",
    "64",
    "--window",
    "80",
    "--drift",
    "2",
    "--interval",
    "5",
    "--report-every",
    "10",
]


def load():
    spec = importlib.util.spec_from_file_location("examples_zch", ROOT / "examples" / "zch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_zch_example_reports_hits_and_evictions(capsys):
    out = load().main([*TINY, "--policy", "lru"])
    printed = capsys.readouterr().out
    assert "hit user" in printed and "30 steps in" in printed
    report = out["report"]
    assert [r["step"] for r in report] == [10, 20, 30]
    for r in report:
        assert all(0.0 <= h <= 1.0 for h in r["hit_rate"]) and all(e >= 0 for e in r["evicted"])
        assert all(0 <= f <= 63 for f in r["free"])
    # The first interval fills the empty tables; later ones keep admitting drifting ids.
    assert all(e >= 40 for e in report[0]["evicted"]) and all(e > 0 for e in report[-1]["evicted"])
    # Once warm, LRU keeps most of the window's ids (63 rows for an 80-id window).
    assert all(h > 0.6 for h in report[-1]["hit_rate"])
