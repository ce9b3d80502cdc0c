"""How long the cache's exchange of ids between processes takes: ``jaxrec.cache.exchange``
(its own TCP connections) against ``jax.distributed``'s key-value store, which it
replaced. Two processes on 127.0.0.1; payloads of the sizes a batch's cached ids take
(the GPU preset of ``bench/cache.py``: 4 tables x 8192 x 20 int32 ids = 2.6 MB a
process). Prints one JSON line per payload size (medians; the machine named).

    python bench/cache_exchange.py [--sizes-mb 0.01,0.3,2.6,10.4] [--reps 20]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(process_id: int, port: int, sizes_mb: list[float], reps: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    import numpy as np
    from jax._src import distributed

    from jaxrec.cache import exchange

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    peers = exchange.Peers("bench", 120)
    client = distributed.global_state.client
    for mb in sizes_mb:
        rng = np.random.default_rng(process_id)
        payload = rng.integers(0, 1 << 30, int(mb * 2**20) // 4, dtype=np.int32).tobytes()
        tcp, kv = [], []
        for r in range(reps + 2):
            t0 = time.perf_counter()
            got = peers.allgather(payload, "bench")
            tcp.append((time.perf_counter() - t0) * 1e3)
            assert len(got[1 - process_id]) == len(payload)
            t0 = time.perf_counter()
            client.key_value_set_bytes(f"kv/{mb}/{r}/{process_id}", payload)
            other = client.blocking_key_value_get_bytes(f"kv/{mb}/{r}/{1 - process_id}", 120_000)
            kv.append((time.perf_counter() - t0) * 1e3)
            assert len(other) == len(payload)
        if process_id == 0:
            tcp_ms, kv_ms = statistics.median(tcp[2:]), statistics.median(kv[2:])
            print(
                json.dumps(
                    {
                        "payload_MB": mb,
                        "exchange_ms": round(tcp_ms, 3),
                        "key_value_store_ms": round(kv_ms, 3),
                        "exchange_MBps": round(mb / tcp_ms * 1e3, 1),
                        "key_value_store_MBps": round(mb / kv_ms * 1e3, 1),
                    }
                ),
                flush=True,
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mb", default="0.01,0.3,2.6,10.4")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes = [float(x) for x in a.sizes_mb.split(",")]
    if a.worker:
        worker(*a.worker, sizes, a.reps)
        return 0
    sys.path.insert(0, HERE)
    from common import machine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    paths = [os.path.dirname(HERE), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, __file__, "--sizes-mb", a.sizes_mb, "--reps", str(a.reps), "--worker"]
    procs = [
        subprocess.Popen([*cmd, str(i), str(port)], env=env, stdout=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    out = [q.communicate(timeout=600)[0] for q in procs]
    if any(q.returncode for q in procs):
        print(out, file=sys.stderr)
        return 1
    base = {
        "bench": "cache_exchange",
        "date": datetime.date.today().isoformat(),
        "processes": 2,
        **machine(),
    }
    for line in out[0].splitlines():
        if line.startswith("{"):
            print(json.dumps({**base, **json.loads(line)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
