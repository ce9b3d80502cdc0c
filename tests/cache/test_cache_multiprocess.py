"""Cached tables across two processes (2 CPU devices each, gloo collectives): each
process holds its own shards' host rows and maps, plans its own shards on every
process's ids of them, and trains exactly as the all-device model does; a checkpoint
written by both restores into either model (``cache_multiprocess_worker.py``)."""

import os

import pytest
from processes import gloo_available, run_workers

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.skipif(not gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_two_processes_train_and_checkpoint_like_all_device(tmp_path):
    worker = os.path.join(HERE, "cache_multiprocess_worker.py")
    a, b = run_workers(worker, [str(tmp_path)], 300, paths=[REPO])
    assert a["ok"] and b["ok"], (a, b)
    # each holds its own rows: big's two shards each, mean (rank 2) on process 1 only
    assert a["rows"] == {"big": [0, 100], "mean": [0, 0]}
    assert b["rows"] == {"big": [100, 200], "mean": [0, 120]}
    # each keeps and plans its own shards' maps only
    assert a["owns"] == {"big": [True, True, False, False], "mean": [False]}
    assert b["owns"] == {"big": [False, False, True, True], "mean": [True]}
    assert a["stats"]["mean"] == [0, 0] and min(b["stats"]["mean"]) > 0
    assert "process 1 refused this batch" in a["refused"][0]
    assert "host table 'big' field 'weight'" in b["refused"][0]
    # process 0's ids overfill shard 3, which process 1 plans: both refuse the batch
    assert "process 1 refused this batch" in a["refused"][1]
    assert "cached table 'big' shard 3" in a["refused"][1]
    assert "cached table 'big' shard 3" in b["refused"][1]
    assert "load_factor" in b["refused"][1]
