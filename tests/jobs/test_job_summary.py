"""The job's figures mean one thing each: the summary's samples_per_s is the progress
lines' rate (steady state: the first step, which compiles, is first_step_seconds),
and every loss printed names its unit (training loss in nats, TorchRec's log loss in bits)."""

import json
import re

from jaxrec.jobs.train_dlrm import main

TINY = ["--num-train", "3072", "--num-eval", "1000", "--batch-size", "128", "--no-checkpoint"]


def test_summary_rate_is_the_progress_rate_and_units_are_named(tmp_path, capsys):
    assert main([*TINY, "--run-dir", str(tmp_path / "r"), "--eval-every", "12"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "r" / "summary.json").read_text())
    assert 0 < summary["first_step_seconds"] <= summary["train_seconds"]
    steady = (summary["samples"] - 128) / (summary["train_seconds"] - summary["first_step_seconds"])
    assert abs(summary["samples_per_s"] / steady - 1) < 0.15  # the seconds are rounded to 0.01
    last = [ln for ln in err.splitlines() if ln.startswith("step 24/24")][0]
    shown = float(re.search(r"([\d,]+) samples/s", last)[1].replace(",", ""))
    # Measured a moment apart over the same steps (the first step's compile alone takes
    # longer than all the others: a rate that included it would be far off).
    assert 0.5 < shown / summary["samples_per_s"] < 2, (last, summary)
    assert re.search(r"loss \d\.\d{4} nats", last)
    evals = [ln for ln in err.splitlines() if ": eval " in ln]
    assert len(evals) == 2 and all(re.search(r"logloss \d\.\d{4} bits", ln) for ln in evals)
    assert "logloss" in summary["eval"]  # the key stays TorchRec's (bits)
