"""Sharded training across two processes (2 CPU devices each, gloo collectives).

Launches ``multiprocess_worker.py`` twice on 127.0.0.1: the processes form one
4-device mesh through ``jax.distributed.initialize``, train a sharded model
(row-wise, table-wise, column-wise and data-parallel tables) and compare it
with unsharded training on the global batch; each exits non-zero on a mismatch.
"""

import os

import pytest
from processes import gloo_available, run_workers

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")


@pytest.mark.skipif(not gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_two_processes_train_like_unsharded():
    for report in run_workers(WORKER, [], 240):  # 2 devices per process
        assert report["ok"], report
