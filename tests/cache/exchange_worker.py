"""One process of the exchange test (see ``test_exchange.py``):
``python exchange_worker.py <process_id> <port> <mode>``.

``gather``: three allgathers (empty, small, 5 MB payloads, each process's own bytes)
must return every process's payload in process order, and an exchange of bytes that
differ by receiver each process's bytes for this one; once closed, the threads end and a
call is refused. ``stop``: process 1 exits once
connected; process 0's allgather must fail with a message naming it, well before the
test's deadline, and a second one must be refused. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import jax

jax.config.update("jax_num_cpu_devices", 1)

import numpy as np  # noqa: E402

from jaxrec.cache import exchange  # noqa: E402


def payload(process: int, size: int) -> bytes:
    return np.random.default_rng([process, size]).integers(0, 255, size, np.uint8).tobytes()


def threads_end(prefix: str, within_s: float = 5.0) -> bool:
    t0 = time.monotonic()
    while any(t.name.startswith(prefix) for t in threading.enumerate()):
        if time.monotonic() - t0 > within_s:
            return False
        time.sleep(0.01)
    return True


def main(process_id: int, port: int, mode: str) -> int:
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    peers = exchange.Peers("test", timeout_s=20)
    if mode == "gather":
        ok = True
        for size in (0, 1000, 5 << 20):
            got = peers.allgather(payload(process_id, size), f"size {size}")
            ok &= got == [payload(q, size) for q in range(2)]
        # each process its own bytes: q sends j the payload of (q, 10 + j) bytes
        got = peers.exchange([payload(process_id, 10 + j) for j in range(2)], "to each")
        ok &= got == [payload(q, 10 + process_id) for q in range(2)]
        peers.close()  # its threads end; a later call is refused
        try:
            peers.allgather(b"ids", "after close")
            ok = False
        except RuntimeError as e:
            ok &= "closed by this process" in str(e)
        ok &= threads_end("jaxrec-peers")
        print(json.dumps({"process": process_id, "ok": ok}), flush=True)
        return 0 if ok else 1
    if process_id == 1:  # stops without sending
        print(json.dumps({"process": 1, "ok": True}), flush=True)
        os._exit(0)
    t0 = time.perf_counter()
    try:
        peers.allgather(b"ids", "batch 1")
        error = None
    except TimeoutError as e:
        error = str(e)
    seconds = time.perf_counter() - t0
    try:
        peers.allgather(b"ids", "batch 2")
        again = None
    except RuntimeError as e:
        again = str(e)
    report = {"process": 0, "ok": error is not None, "error": error, "s": seconds, "again": again}
    print(json.dumps(report), flush=True)
    os._exit(0)  # the coordinator would wait for the stopped process at shutdown


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
