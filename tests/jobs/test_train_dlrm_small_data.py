"""The job with less training data than one global batch: a clear error, not ZeroDivisionError."""

import pytest

from jaxrec.jobs.train_dlrm import main


def test_training_data_smaller_than_one_batch(tmp_path):
    argv = ["--num-train", "100", "--num-eval", "50", "--batch-size", "128", "--quiet"]
    argv += ["--no-checkpoint", "--run-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit, match=r"100 training rows.*one global batch of 128"):
        main(argv)
