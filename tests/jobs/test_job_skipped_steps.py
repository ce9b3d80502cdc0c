"""The job skips batches whose loss is not finite, counts them and reports the count."""

import json

import numpy as np

from jaxrec.jobs import dlrm_parts, train_dlrm
from jaxrec.jobs.train_dlrm import main

ARGS = ["--num-train", "1536", "--num-eval", "500", "--batch-size", "128", "--no-checkpoint"]


class Poisoned:
    """A training set whose batch ``bad`` (of each epoch) has a NaN dense feature."""

    def __init__(self, data, bad):
        self.data, self.bad = data, bad

    def __getattr__(self, name):
        return getattr(self.data, name)

    def batches(self, *args, **kwargs):
        for i, b in enumerate(self.data.batches(*args, **kwargs)):
            if i == self.bad:
                dense = np.array(b.dense_features, np.float32)
                dense[3, 0] = np.nan
                b = b._replace(dense_features=dense)
            yield b


def test_nan_batch_is_skipped_and_reported(tmp_path, monkeypatch, capsys):
    load = dlrm_parts.load_data

    def poisoned_load(args):
        train, evals = load(args)
        return Poisoned(train, bad=4), evals

    # main looks load_data up in its own module (imported from dlrm_parts at import time)
    monkeypatch.setattr(train_dlrm, "load_data", poisoned_load)
    run_dir = tmp_path / "run"
    assert main([*ARGS, "--run-dir", str(run_dir)]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["skipped_steps"] == 1
    assert np.isfinite(summary["eval"]["logloss"]) and summary["eval"]["auc"] > 0.5
    assert "skipped 1" in capsys.readouterr().err  # the progress line


def test_clean_run_reports_no_skipped_steps(tmp_path):
    run_dir = tmp_path / "run"
    assert main([*ARGS, "--quiet", "--run-dir", str(run_dir)]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["skipped_steps"] == 0
