"""The server under concurrent load (loopback, every wait bounded): idle and
slow-loris connections do not delay a valid request, and concurrent requests
batched into one model call each get exactly their own rows back, a bad one
failing alone."""

import http.client
import json
import socket
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from export_cases import KEYS, make_batch, make_model

from jaxrec.inference import PredictionServer, export, load
from jaxrec.inference.serving import predict_instances


def instances(b, seed):
    dense, _, raw = make_batch(b, seed)
    return [{"dense": dense[i].tolist(), "sparse": {k: raw[k][i] for k in KEYS}} for i in range(b)]


def post(server, body: dict, timeout=30.0):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=timeout)
    try:
        conn.request("POST", "/predict", body=json.dumps(body))
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def still_open(sock: socket.socket) -> bool:
    """Whether the server has neither closed nor written to ``sock``."""
    sock.settimeout(0)  # non-blocking: no data and no EOF raise BlockingIOError
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def test_idle_and_slow_clients_do_not_delay_a_valid_request(dlrm_artifact):
    """50 idle connections and a client trickling its headers (all far longer than
    the server's worker count, which once held every worker) while a valid
    request is sent: it is answered while they are all still open."""
    server = PredictionServer(
        load(dlrm_artifact), port=0, max_workers=2, idle_timeout=60, request_timeout=60
    ).start()
    addr = server.server_address[:2]
    idle, stop = [], threading.Event()

    def slow_loris(sock):
        head = b"POST /predict HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 1000
        for i in range(len(head)):  # a byte every 50 ms: 50 s for the whole head
            if stop.wait(0.05):
                return
            try:
                sock.sendall(head[i : i + 1])
            except OSError:
                return

    try:
        idle = [socket.create_connection(addr, timeout=10) for _ in range(50)]
        loris = socket.create_connection(addr, timeout=10)
        idle.append(loris)
        trickle = threading.Thread(target=slow_loris, args=(loris,), daemon=True)
        trickle.start()
        deadline = time.monotonic() + 10
        while server.active < len(idle) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.active == len(idle)
        time.sleep(0.2)  # the slow client has started its headers
        status, body = post(server, {"instances": instances(2, seed=1)}, timeout=20)
        assert status == 200 and len(body["predictions"]) == 2
        assert all(still_open(s) for s in idle), "answered only after the idle ones went"
    finally:
        stop.set()
        for s in idle:
            s.close()
        server.stop()


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory):
    """The test DLRM, NaN for an instance whose first dense input exceeds 100."""

    def apply(m, d, s):
        return jnp.where(d[:, :1] > 100.0, jnp.nan, m(d, s))

    path = tmp_path_factory.mktemp("nan") / "art"
    dense, kjt, _ = make_batch(2)
    export(make_model(), (dense, kjt), path, apply_fn=apply)
    return load(path)


def test_batched_requests_each_get_their_own_rows(nan_model):
    model = nan_model
    n = 24
    bodies = [instances(i % 3 + 1, seed=100 + i) for i in range(n)]
    bodies[5][0]["sparse"][KEYS[0]] = [10**6]  # invalid: fails in decoding
    bodies[11][-1]["dense"][0] = 500.0  # valid, but its output is NaN: fails in the batch
    want = {i: predict_instances(model, b) for i, b in enumerate(bodies) if i not in (5, 11)}
    server = PredictionServer(
        model, port=0, max_batch_size=64, batch_timeout_ms=200, max_workers=4
    ).start()
    results = [None] * n
    barrier = threading.Barrier(n, timeout=20)

    def client(i):
        try:
            barrier.wait()
            results[i] = post(server, {"instances": bodies[i]})
        except Exception as e:  # recorded, asserted below
            results[i] = e

    try:
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = server.stats
    finally:
        server.stop()
    assert all(isinstance(r, tuple) for r in results), results
    for i, (status, body) in enumerate(results):
        if i == 5:
            assert status == 400 and "outside [0, " in body["error"]
        elif i == 11:
            last = len(bodies[11]) - 1
            assert status == 500 and f"instance(s) [{last}]" in body["error"]
        else:
            assert status == 200, body
            np.testing.assert_allclose(body["predictions"], want[i], rtol=1e-6, atol=1e-7)
    # requests shared calls, and every call used a power-of-two bucket
    assert stats["largest_batch"] > 3 and stats["calls"] < n - 1, stats
    assert all(b & (b - 1) == 0 for b in model.compiled_batch_sizes)
