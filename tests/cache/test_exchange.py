"""The cache's exchange of ids between processes (``jaxrec.cache.exchange``): payloads
arrive whole and in process order; a process that stops is named, not waited on."""

import os

from processes import run_workers

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "exchange_worker.py")
REPO = os.path.dirname(os.path.dirname(HERE))


def test_allgather_returns_every_payload_in_order():
    assert all(r["ok"] for r in run_workers(WORKER, ["gather"], 120, paths=[REPO]))


def test_a_stopped_process_is_named():
    r = run_workers(WORKER, ["stop"], 120, paths=[REPO])[0]
    assert r["ok"] and "process 1" in r["error"] and "closed its connection" in r["error"]
    assert r["s"] < 15  # the closed connection is seen, not the 20 s timeout waited out
    assert "failed earlier" in r["again"]  # a broken exchange is not used again
