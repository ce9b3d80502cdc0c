"""Load test of the prediction server with ``wrk`` on loopback: throughput and
latency at several client counts, with and without dynamic batching, with and
without idle connections held open, against the server of a base commit.

For each server variant and each ``--clients`` setting, ``wrk`` (a separate C
process: ``apt-get install wrk``) keeps that many keep-alive connections busy
for ``--seconds``, each request carrying ``--instances`` random instances
(``--bodies`` distinct bodies, rotated). With ``--idle N`` the bench also
holds N connections open that never send a byte, reopening any the server
closes (a persistent idle client, the attack that stalled the old server).
Variants:

* ``base``: ``PredictionServer`` as of ``--baseline`` (a git revision; its
  ``serving.py`` is loaded from git), the thread-pool server;
* ``unbatched``: this server with ``max_batch_size=1`` (one call per request);
* ``batched``: this server with ``max_batch_size=256``, ``batch_timeout_ms=0``;
* ``batched_wait``: ``batch_timeout_ms=--wait-ms``.

One JSON line per run (requests/s, instances/s, p50/p90/p99 latency as wrk
measures it, non-2xx answers, socket errors and timeouts, model calls and
mean instances per call), after a ``reference`` line: the direct
``predict_instances`` call at the request's size and at 256 instances (no HTTP),
timed in the same run. The server shares this process (one Python, the GIL)
and wrk takes CPU from it: on 2 cores the figures are a floor.

Run from the repository root::

    PYTHONPATH=. python bench/serving_load.py --out bench/results/serving_load.jsonl
    PYTHONPATH=. python bench/serving_load.py --clients 16 --idle 0 --variants batched
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from common import emit, machine
from serve import make_instances, tiny_artifact

from jaxrec.inference import PredictionServer, load
from jaxrec.inference.serving import predict_instances

BENCH = "serving_load"
REPO = Path(__file__).resolve().parent.parent
VARIANTS = {
    "base": None,
    "unbatched": dict(max_batch_size=1),
    "batched": dict(max_batch_size=256, batch_timeout_ms=0.0),
    "batched_wait": dict(max_batch_size=256),  # batch_timeout_ms from --wait-ms
}
MAX_SECONDS = 60  # bounded: a load test, not a soak test


def base_server_class(rev: str):
    """``PredictionServer`` from ``jaxrec/inference/serving.py`` at git revision ``rev``."""
    src = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:jaxrec/inference/serving.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "serving_base.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("jaxrec.inference._serving_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # relative imports resolve in jaxrec.inference
    return module.PredictionServer


class IdleClients:
    """Holds ``n`` connections open without sending, reopening closed ones."""

    def __init__(self, addr, n: int):
        self.addr, self.n = addr, n
        self.socks: list[socket.socket] = []
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hold, daemon=True)

    def __enter__(self) -> IdleClients:
        for _ in range(self.n):
            self.socks.append(socket.create_connection(self.addr, timeout=5))
        self._thread.start()
        return self

    def _hold(self) -> None:
        while not self._stop.is_set() and self.socks:
            ready, _, _ = select.select(self.socks, [], [], 0.2)
            for s in ready:  # the server wrote (a 503) or closed: reconnect
                self.socks.remove(s)
                s.close()
                if self._stop.is_set():
                    return
                try:
                    self.socks.append(socket.create_connection(self.addr, timeout=5))
                    self.reopened += 1
                except OSError:
                    pass

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks:
            s.close()


LUA = """
local bodies = { %s }
local i = 0
request = function()
  i = i %% #bodies + 1
  return wrk.format("POST", "/predict", {["Content-Type"] = "application/json"}, bodies[i])
end
"""


def wrk(url: str, script: Path, clients: int, seconds: float, timeout_s: float) -> dict:
    cmd = ["wrk", "-t1", f"-c{clients}", f"-d{seconds:g}s", f"--timeout={timeout_s:g}s"]
    cmd += ["--latency", "-s", str(script), url]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=seconds + 60)
    return parse_wrk(out.stdout)


_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    assert m, text
    return round(float(m.group(1)) * _UNIT[m.group(2)], 3)


def parse_wrk(text: str) -> dict:
    """wrk's report as numbers (latencies in ms)."""
    rec: dict = {}
    for pct in ("50", "90", "99"):
        m = re.search(rf"^\s+{pct}%\s+(\S+)", text, re.M)
        rec[f"p{pct}_ms"] = _ms(m.group(1)) if m else None
    m = re.search(r"(\d+) requests in ([\d.]+)(\w+)", text)
    rec["requests"] = int(m.group(1))
    rec["wrk_seconds"] = _ms(m.group(2) + m.group(3)) / 1e3
    m = re.search(r"Requests/sec:\s+([\d.]+)", text)
    rec["requests_per_s"] = float(m.group(1))
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    rec["non_2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    errs = [int(x) for x in m.groups()] if m else [0, 0, 0, 0]
    rec["socket_errors"] = sum(errs[:3])
    rec["timeouts"] = errs[3]
    if not rec["requests"]:  # wrk prints 0.00us: no latency was measured
        rec.update(p50_ms=None, p90_ms=None, p99_ms=None)
    return rec


def direct_ms(model, insts: list, reps: int = 200) -> float:
    """Median ms of ``predict_instances`` (decode, pad, call) without HTTP."""
    predict_instances(model, insts)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        predict_instances(model, insts)
        times.append(time.perf_counter() - t0)
    return round(float(np.median(times)) * 1e3, 4)


def run_one(model, variant, server_cls, kw, *, clients, idle, seconds, script, instances, env):
    server = server_cls(model, port=0, max_instances=max(instances, 1), **kw).start()
    try:
        if hasattr(server, "warm_up"):
            server.warm_up()
        addr = server.server_address[:2]
        url = f"http://{addr[0]}:{addr[1]}"
        holder = IdleClients(addr, idle)
        with holder:
            time.sleep(0.3 if idle else 0)  # accepted before the load starts
            rec = wrk(url, script, clients, seconds, timeout_s=5)
        stats = getattr(server, "stats", None)
    finally:
        server.stop()
    ok = rec["requests"] - rec["non_2xx"]
    rec = {
        "bench": BENCH,
        "variant": variant,
        "clients": clients,
        "idle_connections": idle,
        "idle_reopened": holder.reopened,
        "instances_per_request": instances,
        **rec,
        "instances_per_s": round(ok * instances / rec["wrk_seconds"], 1),
        **{k: v for k, v in kw.items()},
        **env,
    }
    if stats:
        rec["model_calls"] = stats["calls"]
        rec["mean_batch"] = round(stats["instances"] / max(stats["calls"], 1), 2)
        rec["largest_batch"] = stats["largest_batch"]
    return rec


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,16,200", help="wrk connections, comma-separated")
    p.add_argument("--idle", default="0,100", help="idle connections held open, comma-separated")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"from {list(VARIANTS)}")
    p.add_argument("--baseline", default="c6d66be", help="git revision of the base server")
    p.add_argument("--seconds", type=float, default=4.0, help=f"per run, <= {MAX_SECONDS}")
    p.add_argument("--instances", type=int, default=4, help="instances per request")
    p.add_argument("--bodies", type=int, default=8, help="distinct request bodies")
    p.add_argument("--wait-ms", type=float, default=2.0, help="batched_wait's batch_timeout_ms")
    p.add_argument("--T", type=int, default=8, help="model: sparse features (tables)")
    p.add_argument("--E", type=int, default=1000, help="model: rows per table")
    p.add_argument("--D", type=int, default=16, help="model: embedding dim")
    p.add_argument("--out", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    if shutil.which("wrk") is None:
        p.error("needs wrk on PATH (Debian: apt-get install wrk)")
    if not 0 < args.seconds <= MAX_SECONDS:
        p.error(f"--seconds must be in (0, {MAX_SECONDS}]")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; use {list(VARIANTS)}")
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split()
    env = {
        **machine(),
        "jax_version": jax.__version__,
        "platform": jax.devices()[0].platform,
        "load_generator": " ".join(wrk_version[:2]),
        "model": f"tiny_dlrm(T={args.T},E={args.E},D={args.D})",
    }
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_artifact(Path(tmp) / "dlrm", num_tables=args.T, rows=args.E, dim=args.D)
        model = load(path, max_batch_size=256)
        bodies = [make_instances(model, args.instances, rng) for _ in range(args.bodies)]
        script = Path(tmp) / "bodies.lua"
        quoted = ", ".join(f"[=[{json.dumps({'instances': b})}]=]" for b in bodies)
        script.write_text(LUA % quoted)
        big = [x for b in bodies for x in b] * (256 // (args.instances * args.bodies) + 1)
        emit(
            {
                "bench": BENCH,
                "variant": "reference",
                "direct_call_ms": direct_ms(model, bodies[0]),
                "direct_instances": args.instances,
                "direct_call_256_ms": direct_ms(model, big[:256], reps=50),
                "loadavg_1m": round(os.getloadavg()[0], 2),
                **env,
            },
            args.out,
        )
        servers = {}
        for variant in variants:
            if variant == "base":
                servers[variant] = base_server_class(args.baseline), {}
            else:
                kw = dict(VARIANTS[variant])
                if variant == "batched_wait":
                    kw["batch_timeout_ms"] = args.wait_ms
                servers[variant] = PredictionServer, kw
        # variants interleaved per setting: a busy host's load drifts over minutes
        for idle in (int(x) for x in args.idle.split(",")):
            for clients in (int(x) for x in args.clients.split(",")):
                for variant, (cls, kw) in servers.items():
                    rec = run_one(
                        model,
                        variant,
                        cls,
                        kw,
                        clients=clients,
                        idle=idle,
                        seconds=args.seconds,
                        script=script,
                        instances=args.instances,
                        env={**env, "baseline": args.baseline} if variant == "base" else env,
                    )
                    rec["loadavg_1m"] = round(os.getloadavg()[0], 2)
                    emit(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
