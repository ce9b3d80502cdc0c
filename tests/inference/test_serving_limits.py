"""The HTTP server under load and abuse (loopback only; every loop bounded in count
and time): a burst of 200 connections gets 200s or 503s (no resets), idle and slow
connections are closed, every malformed request class gets its 4xx JSON, non-finite
inputs are 400 and non-finite outputs a 500 JSON error, never a NaN."""

import contextlib
import http.client
import json
import re
import socket
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from export_cases import KEYS, NUM_DENSE, make_batch, make_model

from jaxrec.inference import PredictionServer, export, load


@pytest.fixture(scope="module")
def loaded(dlrm_artifact):
    return load(dlrm_artifact)


@pytest.fixture
def serve(loaded):
    servers = []

    def start(**kw):
        servers.append(PredictionServer(loaded, port=0, **kw).start())
        return servers[-1]

    yield start
    for s in servers:
        t0 = time.monotonic()
        s.stop()
        assert time.monotonic() - t0 < 5, "stop() must not wait on open connections"


def good_body(n=1):
    inst = {"dense": [0.5] * NUM_DENSE, "sparse": {k: [1] for k in KEYS}}
    return json.dumps({"instances": [inst] * n}).encode()


def exchange(server, data: bytes, timeout=10.0):
    """Sends raw bytes; returns (status, headers, parsed JSON body)."""
    with socket.create_connection(server.server_address[:2], timeout=timeout) as sock:
        sock.sendall(data)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        raw = resp.read()
        resp.close()
        assert resp.getheader("Content-Type") == "application/json", raw[:200]
        return resp.status, resp, json.loads(raw)


def post(path, body: bytes, headers=""):
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{headers}\r\n"
    return head.encode() + body


def test_burst_of_200_connections_gets_200_or_503_never_a_reset(serve):
    server = serve(max_workers=4, max_queued=16)
    n = 200
    results, barrier = [None] * n, threading.Barrier(n, timeout=20)

    def client(i):
        try:
            barrier.wait()
            conn = http.client.HTTPConnection(*server.server_address[:2], timeout=20)
            conn.request("POST", "/predict", body=good_body(2))
            resp = conn.getresponse()
            results[i] = (resp.status, json.loads(resp.read()))
            conn.close()
        except Exception as e:  # recorded, asserted below
            results[i] = e

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.1, 60 - (time.monotonic() - t0)))
    errors = [r for r in results if not isinstance(r, tuple)]
    assert not errors, f"{len(errors)} of {n} failed, e.g. {errors[:3]}"
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 503}, sorted(set(statuses))
    assert statuses.count(200) >= 4
    for s, body in results:
        assert ("predictions" in body) if s == 200 else ("busy" in body["error"])
    # and the server still answers
    status, _, body = exchange(server, post("/predict", good_body()))
    assert status == 200 and len(body["predictions"]) == 1


def wait_until(cond, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_too_many_connections_get_503_json(serve):
    server = serve(max_connections=1, idle_timeout=3.0)
    addr = server.server_address[:2]
    hold = socket.create_connection(addr, timeout=5)  # idle: the one connection allowed
    assert wait_until(lambda: server.active == 1)
    status, resp, body = exchange(server, post("/predict", good_body()))
    assert status == 503 and "busy" in body["error"] and resp.getheader("Retry-After") == "1"
    assert server.stats["refused_connections"] == 1
    hold.close()
    assert wait_until(lambda: server.active == 0)
    status, _, body = exchange(server, post("/predict", good_body()))
    assert status == 200 and len(body["predictions"]) == 1


class _BlockingModel:
    """The loaded model, whose calls wait for ``release``."""

    def __init__(self, model):
        self._model, self.release = model, threading.Event()

    def __getattr__(self, name):
        return getattr(self._model, name)

    def run(self, *arrays):
        assert self.release.wait(20)
        return self._model.run(*arrays)


def test_full_queue_gets_503_json(loaded):
    model = _BlockingModel(loaded)
    server = PredictionServer(model, port=0, max_queued=1).start()
    try:
        first = []
        t = threading.Thread(
            target=lambda: first.append(exchange(server, post("/predict", good_body())))
        )
        t.start()
        assert wait_until(lambda: server.queued == 1)  # in the model, which waits
        status, resp, body = exchange(server, post("/predict", good_body()))
        assert status == 503 and "busy" in body["error"] and resp.getheader("Retry-After") == "1"
        model.release.set()
        t.join(20)
        assert first and first[0][0] == 200 and len(first[0][2]["predictions"]) == 1
    finally:
        model.release.set()
        server.stop()


def test_idle_connection_is_closed(serve):
    server = serve(idle_timeout=0.5)
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        t0 = time.monotonic()
        assert sock.recv(1) == b""  # EOF: the server closed it
        assert 0.3 < time.monotonic() - t0 < 5


def test_idle_keep_alive_connection_is_closed_after_a_request(serve):
    server = serve(idle_timeout=0.5)
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        sock.sendall(post("/predict", good_body()))
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        assert resp.status == 200 and resp.getheader("Connection") != "close"
        resp.read()
        t0 = time.monotonic()
        assert sock.recv(1) == b""
        assert time.monotonic() - t0 < 5


def test_slow_body_gets_408(serve):
    server = serve(idle_timeout=0.4, request_timeout=1.0)
    body = good_body()
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        sock.sendall(f"POST /predict HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        t0 = time.monotonic()
        for i in range(10):  # a byte every 0.2 s: no read stalls 0.4 s, the whole takes 2 s
            try:
                sock.sendall(body[i : i + 1])
            except OSError:
                break
            time.sleep(0.2)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        assert resp.status == 408 and "in time" in json.loads(resp.read())["error"]
        assert time.monotonic() - t0 < 5


BIG_INT = "1" + "0" * 5000
NEST = "[" * 100 + "]" * 100


def _inst_text(dense="[0.5, 0.5, 0.5, 0.5]", sparse=None, extra=""):
    sparse = sparse or json.dumps({k: [1] for k in KEYS})
    return f'{{"instances": [{{"dense": {dense}, "sparse": {sparse}{extra}}}]}}'


MALFORMED = {
    # name: (raw request, status, error regex)
    "bad_json": (post("/predict", b"{nope"), 400, "not valid JSON"),
    "not_utf8": (post("/predict", b'{"instances": "\xff\xfe"}'), 400, "not UTF-8"),
    "nan_literal": (post("/predict", _inst_text("[NaN, 0, 0, 0]").encode()), 400, "NaN literal"),
    "infinity_literal": (
        post("/predict", _inst_text("[0, -Infinity, 0, 0]").encode()),
        400,
        "-Infinity literal",
    ),
    "float32_overflow": (
        post("/predict", _inst_text("[0, 0, 1e39, 0]").encode()),
        400,
        r"'dense'\[2\] = 1e\+39 is not finite as float32",
    ),
    "huge_int_dense": (
        post("/predict", _inst_text(f"[0, 0, 0, {BIG_INT}]").encode()),
        400,
        "not valid JSON.*digits",
    ),
    "huge_id": (
        post(
            "/predict", _inst_text(sparse=json.dumps({"f0": [2**70], "f1": [], "f2": []})).encode()
        ),
        400,
        r"id 1180591620717411303424 is outside \[0, 50\)",
    ),
    "too_deep": (post("/predict", NEST.encode()), 400, "nests 100 levels deep"),
    "ragged_dense": (
        post("/predict", _inst_text("[[0.5, 0.5], [0.5]]").encode()),
        400,
        r"'dense' has 2 values",
    ),
    "dense_not_numbers": (
        post("/predict", _inst_text('[0, 0, "1", 0]').encode()),
        400,
        r"'dense'\[2\] must be a number, got a string",
    ),
    "bool_id": (
        post("/predict", _inst_text(sparse='{"f0": [true], "f1": [], "f2": []}').encode()),
        400,
        "ids must be integers, got a boolean",
    ),
    "extra_top_level_key": (
        post("/predict", b'{"instances": [], "x": 1}'),
        400,
        r"unknown top-level key\(s\) \['x'\]",
    ),
    "extra_instance_key": (
        post("/predict", _inst_text(extra=', "label": 1').encode()),
        400,
        r"unknown field\(s\) \['label'\]",
    ),
    "instances_not_list": (post("/predict", b'{"instances": 3}'), 400, "must be a list"),
    "top_level_list": (post("/predict", b"[1, 2]"), 400, "must be a JSON object"),
    "no_content_length": (
        b"POST /predict HTTP/1.1\r\nHost: x\r\n\r\n",
        411,
        "needs a Content-Length",
    ),
    "chunked": (
        b"POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\n\r\n",
        411,
        "chunked",
    ),
    "bad_content_length": (
        b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n",
        400,
        "bad Content-Length",
    ),
    "negative_content_length": (
        b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        400,
        "bad Content-Length",
    ),
    "short_body": (
        b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\nConnection: close\r\n\r\n{}",
        None,  # the client half-closes: see the test
        "",
    ),
    "too_large": (post("/predict", b" " * 300_000), 413, "body of 300000 bytes; at most 200000"),
    "too_large_expect_100": (
        b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 300000\r\n"
        b"Expect: 100-continue\r\n\r\n",
        413,
        "at most 200000",
    ),
    "too_many_instances": (post("/predict", good_body(9)), 413, "9 instances.*at most 8"),
    "wrong_path": (post("/nope", b"{}"), 404, "no such path '/nope'"),
    "get_predict": (b"GET /predict HTTP/1.1\r\nHost: x\r\n\r\n", 405, "use POST /predict"),
    "put": (b"PUT /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405, "PUT"),
    "unknown_method": (b"BREW /predict HTTP/1.1\r\nHost: x\r\n\r\n", 405, "'BREW' not allowed"),
    "garbage_request_line": (b"HELLO\r\n\r\n", 400, "Bad request"),
    "header_too_long": (
        b"GET /health HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
        431,
        "Line too long",
    ),
}


@pytest.fixture(scope="module")
def strict_server(loaded):
    server = PredictionServer(loaded, port=0, max_instances=8, max_body_bytes=200_000).start()
    yield server
    server.stop()


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_request_gets_4xx_json(strict_server, case):
    server = strict_server
    raw, status, match = MALFORMED[case]
    if status is None:  # body shorter than Content-Length, then EOF
        with socket.create_connection(server.server_address[:2], timeout=10) as sock:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
            resp = http.client.HTTPResponse(sock)
            resp.begin()
            assert resp.status == 400
            assert "body of 2 bytes; Content-Length is 50" in json.loads(resp.read())["error"]
    else:
        got, resp, body = exchange(server, raw)
        assert got == status, body
        assert set(body) == {"error"}
        assert re.search(match, body["error"]), body["error"]
        if got == 405:
            assert resp.getheader("Allow") in ("POST", "GET", None)
    ok, _, after = exchange(server, post("/predict", good_body()))
    assert ok == 200 and len(after["predictions"]) == 1


def test_oversize_body_413_while_client_still_sends(serve):
    """The client sends the whole 3 MB body (http.client does): the 413 arrives, no reset."""
    server = serve(max_body_bytes=1 << 20)
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=20)
    with contextlib.closing(conn):  # closed on failure too (an unclosed socket warns later)
        conn.request("POST", "/predict", body=b" " * (3 << 20))
        resp = conn.getresponse()
        assert resp.status == 413 and "at most 1048576" in json.loads(resp.read())["error"]


def test_non_finite_output_is_a_500_json_error(tmp_path, serve):
    """A model whose output is NaN for some inputs: never a NaN in the answer."""

    def apply(m, d, s):  # NaN when the first dense feature is > 100
        return jnp.where(d[:, :1] > 100.0, jnp.nan, m(d, s))

    dense, kjt, _ = make_batch(2)
    export(make_model(), (dense, kjt), tmp_path / "nan", apply_fn=apply)
    server = PredictionServer(load(tmp_path / "nan"), port=0).start()
    try:
        inst = [{"dense": [x, 0, 0, 0], "sparse": {k: [1] for k in KEYS}} for x in (0.5, 200.0)]
        status, _, body = exchange(
            server, post("/predict", json.dumps({"instances": inst}).encode())
        )
        assert status == 500 and "NaN/infinite predictions for instance(s) [1]" in body["error"]
        status, _, body = exchange(
            server, post("/predict", json.dumps({"instances": inst[:1]}).encode())
        )
        assert status == 200 and np.isfinite(body["predictions"]).all()
    finally:
        server.stop()


def test_stop_closes_open_connections(serve, loaded):
    server = PredictionServer(loaded, port=0, idle_timeout=30).start()
    sock = socket.create_connection(server.server_address[:2], timeout=10)
    time.sleep(0.1)
    t0 = time.monotonic()
    server.stop()
    assert time.monotonic() - t0 < 3
    assert sock.recv(1) == b""
    sock.close()
