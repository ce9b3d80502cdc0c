"""The cache's exchange of ids between processes (``jaxrec.cache.exchange``): payloads
arrive whole and in process order; a process that stops is named, not waited on."""

import json
import os
import sys

from processes import free_port, run_processes

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "exchange_worker.py")
REPO = os.path.dirname(os.path.dirname(HERE))


def _run(mode: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    port = free_port()
    cmds = [[sys.executable, WORKER, str(i), str(port), mode] for i in range(2)]
    codes, outputs = run_processes(cmds, env, 120)
    reports = []
    for i, (code, out) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"process {i} exited {code}:\n{out[-3000:]}"
        reports.append(json.loads(next(ln for ln in out.splitlines() if ln.startswith('{"proc'))))
    return reports


def test_allgather_returns_every_payload_in_order():
    assert all(r["ok"] for r in _run("gather"))


def test_a_stopped_process_is_named():
    r = _run("stop")[0]
    assert r["ok"] and "process 1" in r["error"] and "closed its connection" in r["error"]
    assert r["s"] < 15  # the closed connection is seen, not the 20 s timeout waited out
