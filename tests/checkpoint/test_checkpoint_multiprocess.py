"""Save and restore across two processes (2 CPU devices each, gloo collectives).

Launches ``checkpoint_worker.py`` twice: both save one checkpoint of a model
sharded over the 4-device mesh into one directory, restore it under two
layouts and compare with the unsharded model (see the worker's docstring).
"""

import os

import pytest
from processes import gloo_available, run_workers

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_worker.py")
# the worker's checkpoint_cases imports the sharding cases of tests/distributed
SHARDING_CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed")


@pytest.mark.skipif(not gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_two_processes_save_and_restore(tmp_path):
    reports = run_workers(WORKER, [str(tmp_path / "ckpt")], 240, paths=[SHARDING_CASES])
    for report in reports:  # 2 devices per process
        assert report["ok"], report
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]
