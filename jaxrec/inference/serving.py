"""An HTTP prediction server and a JSONL batch mode for exported artifacts.

Endpoints:

``POST /predict`` with a JSON body (schema in :mod:`jaxrec.inference.request`)::

    {"instances": [{"dense": [0.1, 0.2, ...],            # num_dense floats
                    "sparse": {"f1": [3, 17], "f2": []}}, # every feature, ids
                   ...]}                                  # <= max_instances

(a weighted model's instances also carry ``"weights": {feature: [one float
per id]}``) answers ``200 {"predictions": [p0, p1, ...]}``: one entry per
instance, a number when the model has one output per sample, else a (nested)
list.

``GET /health`` answers ``200 {"status": "ok", "manifest": {...}}`` (the
artifact's manifest without its weight list and checksums).

Every other answer is a JSON ``{"error": "<what is wrong>"}``:

* ``400`` bad JSON (not UTF-8, ``NaN``/``Infinity`` literals, nested deeper
  than ``max_json_depth``) or a bad instance (unknown or missing feature or
  field, wrong type, ragged or wrong-width dense, non-finite number, too many
  ids, id out of range), a bad ``Content-Length``, a malformed request line;
* ``404`` another path, ``405`` another method (with ``Allow``), ``408`` a body
  not received within ``request_timeout``, ``411`` no ``Content-Length``
  (chunked bodies are not read), ``413`` too many instances or a body over
  ``max_body_bytes``, ``431`` headers too large;
* ``503`` (with ``Retry-After``) when the server is saturated: all workers busy
  and ``max_queued`` connections already waiting;
* ``500`` when the model's output holds NaN/infinity (JSON has no such number:
  the server never sends ``NaN``) or the model call fails.

The server keeps answering after any of them.

**Bounded load.** The listening socket has a ``backlog`` of 1024 (the stdlib
default is 5: a burst of connections was reset by the kernel). Accepted
connections wait in a queue of ``max_queued`` for one of ``max_workers``
threads; past that, a single extra thread answers ``503`` and closes (with a
1 s read limit; if even its queue, ``backlog`` long, is full, the connection is
closed unanswered). A connection idle for ``idle_timeout`` (or a read that
stalls that long) is closed, a request must arrive whole within ``request_timeout``, and a worker
closes a keep-alive connection after its answer when others are waiting.
Threads, memory per request and time per connection are therefore bounded.

**Why the standard library.** This is ``http.server`` on a bounded worker
pool, a few hundred lines, with no dependency. A well-kept server (``waitress``
for WSGI, ``uvicorn`` for ASGI; both install from PyPI) would bring an event
loop for idle connections and years of HTTP edge cases, but also a runtime
dependency for a package whose serving is a demo/template, and their own
plain-text error pages (413, 400, 503) that break the "every error is JSON"
contract here. jaxrec keeps the stdlib server and documents its limits: no
TLS, no auth, no cross-request batching, one thread per active connection
(idle ones time out). For production, call :func:`predict_body` from the
framework of your choice (it takes the body bytes and returns a status and a
JSON payload).

Each request's batch is padded to a power-of-two bucket by the loaded model,
so at most ``log2(max_instances) + 1`` shapes are ever compiled.
"""

from __future__ import annotations

import contextlib
import io
import json
import queue
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .artifact import ExportedModel, InputError
from .request import (
    MAX_JSON_DEPTH,
    NonFiniteOutput,
    RequestError,
    batch_arrays,
    check_finite_output,
    decode_instances,
    decode_request,
    parse_json,
)
from .request import (
    RequestTooLarge as RequestTooLarge,
)

MAX_BODY_BYTES = 8 << 20
MAX_ERROR_CHARS = 1000  # an error message echoes request keys: keep answers small
ROUTES = {"/predict": "POST", "/health": "GET"}


def public_manifest(model: ExportedModel) -> dict:
    """The manifest without the weight file list and the checksums."""
    return {k: v for k, v in model.manifest.items() if k not in ("weights", "integrity")}


def predict_instances(
    model: ExportedModel, instances: Any, max_instances: int | None = None
) -> list:
    """Predictions (JSON-able, finite) for parsed request instances.

    Raises:
        RequestError: a malformed instance.
        NonFiniteOutput: a prediction is NaN or infinite.
    """
    batch = decode_instances(model, instances, max_instances=max_instances)
    return _predict(model, batch)


def _predict(model: ExportedModel, batch) -> list:
    out = model.run(*batch_arrays(model, batch))
    check_finite_output(out)
    return [float(row.reshape(())) if row.size == 1 else row.tolist() for row in out]


def predict_body(
    model: ExportedModel,
    body: bytes,
    *,
    max_instances: int | None = None,
    max_json_depth: int = MAX_JSON_DEPTH,
) -> tuple[int, dict]:
    """``(HTTP status, JSON payload)`` for a ``POST /predict`` body; never raises.

    For use behind any web framework: 200 with predictions, 400/413 for a bad
    request, 500 for a non-finite output or a failing model.
    """
    try:
        batch = decode_request(model, body, max_instances=max_instances, max_depth=max_json_depth)
        return HTTPStatus.OK, {"predictions": _predict(model, batch)}
    except RequestError as e:
        return e.status, {"error": str(e)}
    except InputError as e:  # the model's own host-side checks
        return HTTPStatus.BAD_REQUEST, {"error": str(e)}
    except NonFiniteOutput as e:
        return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(e)}
    except Exception as e:  # never let one request take the server down
        return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"model call failed: {e!r}"}


class PredictionServer(HTTPServer):
    """Serves an :class:`ExportedModel` over HTTP (see the module docstring).

    Args:
        model: the loaded artifact.
        host, port: where to listen (port 0: any free port; see ``url``).
        max_instances: instances allowed per request (more: 413).
        max_workers: threads answering requests.
        max_queued: accepted connections that may wait for a worker; further
            ones get 503.
        backlog: the listening socket's kernel queue of unaccepted connections.
        idle_timeout: seconds a keep-alive connection may wait for its next
            request, and the longest any read may stall.
        request_timeout: seconds within which a request (line, headers, body)
            must arrive once it starts.
        max_body_bytes: the largest body read (larger: 413).
        max_json_depth: the deepest nesting of the body's JSON (deeper: 400).
        quiet: do not log requests to stderr.

    Example:
        >>> server = PredictionServer(load("/tmp/art"), port=0)
        >>> server.start()            # background thread
        >>> server.url                # 'http://127.0.0.1:<port>'
        >>> server.stop()
    """

    def __init__(
        self,
        model: ExportedModel,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        max_instances: int = 256,
        max_workers: int = 8,
        max_queued: int = 64,
        backlog: int = 1024,
        idle_timeout: float = 5.0,
        request_timeout: float = 30.0,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_json_depth: int = MAX_JSON_DEPTH,
        quiet: bool = True,
    ):
        for name, v in dict(max_workers=max_workers, backlog=backlog).items():
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if max_queued < 1 or idle_timeout <= 0 or request_timeout <= 0:
            raise ValueError(
                f"need max_queued >= 1 and positive timeouts, got {max_queued=}, "
                f"{idle_timeout=}, {request_timeout=}"
            )
        self.model = model
        self.max_instances = max_instances
        self.idle_timeout = float(idle_timeout)
        self.request_timeout = float(request_timeout)
        self.max_body_bytes = int(max_body_bytes)
        self.max_json_depth = int(max_json_depth)
        self.quiet = quiet
        self.request_queue_size = int(backlog)  # listen() backlog, read by server_activate
        self._pending: queue.Queue = queue.Queue(maxsize=int(max_queued))
        self._overflow: queue.Queue = queue.Queue(maxsize=int(backlog))
        self._active: set[socket.socket] = set()
        self._active_lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None
        super().__init__((host, port), _Handler)
        self._workers = [
            threading.Thread(target=self._work, args=(self._pending,), daemon=True)
            for _ in range(max_workers)
        ]
        self._workers.append(  # answers 503 to connections no worker can take
            threading.Thread(target=self._work, args=(self._overflow, True), daemon=True)
        )
        for t in self._workers:
            t.start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def queued(self) -> int:
        """Connections waiting for a worker."""
        return self._pending.qsize()

    @property
    def active(self) -> int:
        """Connections being answered now (by workers or the 503 thread)."""
        with self._active_lock:
            return len(self._active)

    def start(self) -> PredictionServer:
        """Serves in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving, closes every connection and the socket."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        self.server_close()

    # ----- socketserver hooks -----
    def process_request(self, request, client_address) -> None:
        """Queues the connection for a worker, or for the 503 thread when full."""
        if _try_put(self._pending, (request, client_address)):
            return
        if not _try_put(self._overflow, (request, client_address)):
            self.shutdown_request(request)  # even the 503 queue is full: drop

    def _work(self, q: queue.Queue, reject: bool = False) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            request, client_address = item
            with self._active_lock:
                self._active.add(request)
            try:
                if self._closed:
                    continue
                _Handler(request, client_address, self, reject=reject)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                with self._active_lock:
                    self._active.discard(request)
                self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        if not self.quiet:
            super().handle_error(request, client_address)

    def server_close(self) -> None:
        """Closes the listening socket and every connection; stops the workers."""
        super().server_close()
        if self._closed:
            return
        self._closed = True
        with self._active_lock:
            for sock in self._active:  # wakes workers blocked reading a connection
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for q, n in ((self._pending, len(self._workers) - 1), (self._overflow, 1)):
            while True:  # connections never served
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self.shutdown_request(item[0])
            for _ in range(n):
                q.put(None)
        for t in self._workers:
            t.join(timeout=self.idle_timeout + 1)


def _try_put(q: queue.Queue, item) -> bool:
    try:
        q.put_nowait(item)
        return True
    except queue.Full:
        return False


class _DeadlineReader(io.RawIOBase):
    """A socket reader: each read stalls at most ``idle`` seconds, and a request
    must arrive within ``total`` seconds of its first byte."""

    def __init__(self, sock: socket.socket, idle: float, total: float):
        self.sock, self.idle, self.total = sock, idle, total
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        timeout = self.idle
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the request did not arrive within {self.total:g} s")
            timeout = min(timeout, left)
        self.sock.settimeout(timeout)
        n = self.sock.recv_into(b)
        if n and self.deadline is None:
            self.deadline = time.monotonic() + self.total
        return n


class _Handler(BaseHTTPRequestHandler):
    server: PredictionServer
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections
    default_request_version = "HTTP/1.0"  # a garbled request line still gets a status line
    # TCP_NODELAY: headers and body go out in two writes; with Nagle on, the body
    # waits for the client's delayed ACK (~40 ms a request on Linux loopback).
    disable_nagle_algorithm = True

    def __init__(self, request, client_address, server, *, reject: bool = False):
        self.reject = reject
        self.linger = False  # unread body bytes: drain them before closing
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        # The 503 thread reads with short limits: it must not be held up.
        idle = min(self.server.idle_timeout, 1.0) if self.reject else self.server.idle_timeout
        total = min(self.server.request_timeout, 2.0) if self.reject else None
        self.timeout = idle  # also bounds writes to a client that does not read
        super().setup()
        self.rfile.close()
        self.reader = _DeadlineReader(self.connection, idle, total or self.server.request_timeout)
        self.rfile = io.BufferedReader(self.reader, 1 << 16)

    def handle_one_request(self) -> None:
        self.reader.deadline = None  # the next request's clock starts at its first byte
        super().handle_one_request()  # a timeout before the body closes silently

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self.linger:
                _drain_and_close(self.connection, self.server.max_body_bytes)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (stdlib signature)
        if not self.server.quiet:
            super().log_message(format, *args)

    # ----- answers -----
    def _send(self, status: int, payload: Mapping, headers: Mapping | None = None) -> None:
        if "error" in payload and len(payload["error"]) > MAX_ERROR_CHARS:
            payload = {"error": payload["error"][:MAX_ERROR_CHARS] + " ..."}
        try:
            body = json.dumps(payload, allow_nan=False).encode()
        except ValueError as e:  # a NaN that got past check_finite_output
            status, body = 500, json.dumps({"error": f"unserializable answer: {e}"}).encode()
        if self.server.queued and not self.close_connection:
            self.close_connection = True  # others wait: free this worker
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, headers: Mapping | None = None) -> None:
        self._send(status, {"error": message}, headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None):
        """The stdlib's errors (bad request line, headers too large...) as JSON."""
        self.close_connection = self.linger = True  # the request is not understood
        if code == HTTPStatus.NOT_IMPLEMENTED:  # an unknown method: not allowed here
            code, message = HTTPStatus.METHOD_NOT_ALLOWED, f"method {self.command!r} not allowed"
        text = message or HTTPStatus(code).phrase
        self.log_error("code %d, message %s", code, text)
        self._error(code, text if not explain else f"{text}: {explain}")

    def handle_expect_100(self) -> bool:
        # Refuse a too-large body before the client sends it.
        if self._length_error() is not None or self.reject:
            self._dispatch()
            return False
        return super().handle_expect_100()

    # ----- routing -----
    def _dispatch(self) -> None:
        path = urlsplit(self.path).path
        if self.reject:
            self.linger, self.close_connection = True, True
            self._error(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "the server is busy (all workers busy, queue full); retry shortly",
                {"Retry-After": "1"},
            )
        elif self.command == ROUTES.get(path) == "POST":
            body = self._body()
            if body is not None:
                status, payload = predict_body(
                    self.server.model,
                    body,
                    max_instances=self.server.max_instances,
                    max_json_depth=self.server.max_json_depth,
                )
                self._send(status, payload)
        else:
            self._skip_body()
            if path not in ROUTES:
                self._error(
                    HTTPStatus.NOT_FOUND, f"no such path {path!r}; use POST /predict or GET /health"
                )
            elif self.command != ROUTES[path]:
                self._error(
                    HTTPStatus.METHOD_NOT_ALLOWED,
                    f"{self.command} {path} is not allowed; use {ROUTES[path]} {path}",
                    {"Allow": ROUTES[path]},
                )
            else:
                manifest = public_manifest(self.server.model)
                self._send(HTTPStatus.OK, {"status": "ok", "manifest": manifest})

    # Other methods get the stdlib's 501, answered as 405 by send_error.
    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _dispatch  # noqa: N815

    def _length_error(self) -> tuple[int, str] | None:
        """Why the body cannot be read (status, message), or None."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return HTTPStatus.LENGTH_REQUIRED, "chunked bodies are not read; send Content-Length"
        values = self.headers.get_all("Content-Length") or []
        if not values:
            if self.command == "POST" and urlsplit(self.path).path == "/predict":
                return HTTPStatus.LENGTH_REQUIRED, "POST /predict needs a Content-Length header"
            return None
        if len(set(values)) > 1 or not values[0].strip().isdigit():
            return HTTPStatus.BAD_REQUEST, f"bad Content-Length header {values!r:.80}"
        n = int(values[0])
        if n > self.server.max_body_bytes:
            return (
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"body of {n} bytes; at most {self.server.max_body_bytes} allowed",
            )
        return None

    def _body(self) -> bytes | None:
        """The request body, or None after answering why it cannot be read."""
        err = self._length_error()
        if err is not None:
            self.linger, self.close_connection = True, True
            self._error(*err)
            return None
        n = int(self.headers["Content-Length"])
        try:
            body = self.rfile.read(n)
        except TimeoutError as e:
            self.linger, self.close_connection = True, True
            self._error(HTTPStatus.REQUEST_TIMEOUT, f"the body did not arrive in time: {e}")
            return None
        if len(body) != n:
            self.close_connection = True
            self._error(HTTPStatus.BAD_REQUEST, f"body of {len(body)} bytes; Content-Length is {n}")
            return None
        return body

    def _skip_body(self) -> None:
        """Reads (and drops) the body of a request answered without it."""
        if self._length_error() is not None:
            self.linger, self.close_connection = True, True
            return
        n = int(self.headers.get("Content-Length") or 0)
        try:
            got = len(self.rfile.read(n)) if n else 0
        except TimeoutError:
            got = -1
        if got != n:
            self.close_connection = True


_DRAIN_BYTES = 64 << 20  # what an answered, refused client may still send


def _drain_and_close(sock: socket.socket, limit: int) -> None:
    """Half-closes, then reads what the client still sends (bounded), so that our
    answer is not lost to a reset: closing with unread data sends a TCP RST."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(0.5)
        # Bounded by time and bytes, but the bytes bound must exceed what a
        # client may still have in flight (a body a few times the limit, or the
        # reset reaches it before our answer; loopback buffers hid this).
        end, n, most = time.monotonic() + 2.0, 0, max(4 * limit, _DRAIN_BYTES)
        while n < most and time.monotonic() < end:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            n += len(chunk)
    except OSError:
        pass


def predict_jsonl(
    model: ExportedModel,
    lines: Iterable[str],
    *,
    batch_size: int = 64,
) -> Iterable[dict]:
    """Batch mode: one instance per JSON line in, one result per line out.

    Each output line is ``{"prediction": ...}`` or, for an invalid line or a
    non-finite prediction, ``{"error": "..."}`` (the other lines of its batch
    are still predicted).
    """
    batch: list[tuple[int, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            batch.append((i, parse_json(line)))
        except RequestError as e:
            batch.append((i, RequestError(f"line {i + 1}: {e}")))
        if len(batch) == batch_size:
            yield from _predict_batch(model, batch)
            batch = []
    if batch:
        yield from _predict_batch(model, batch)


def _predict_batch(model: ExportedModel, batch: Sequence[tuple[int, Any]]) -> Iterable[dict]:
    good = [(i, x) for i, x in batch if not isinstance(x, Exception)]
    try:
        out = predict_instances(model, [x for _, x in good])
        preds = dict(zip((i for i, _ in good), out, strict=True))
    except (InputError, NonFiniteOutput):  # find the bad lines one by one
        preds = {}
        for i, x in good:
            try:
                preds[i] = predict_instances(model, [x])[0]
            except (InputError, NonFiniteOutput) as e:
                preds[i] = RequestError(f"line {i + 1}: {str(e).replace('instance 0: ', '')}")
    for i, x in batch:
        p = x if isinstance(x, Exception) else preds[i]
        yield {"error": str(p)} if isinstance(p, Exception) else {"prediction": p}


def predict_file(
    model: ExportedModel, input_path: str | Path, output_path: str | Path, *, batch_size: int = 64
) -> dict:
    """``predict_jsonl`` from one file to another; returns ``{"lines": n, "errors": m}``."""
    n = errors = 0
    with open(input_path) as src, open(output_path, "w") as dst:
        for result in predict_jsonl(model, src, batch_size=batch_size):
            dst.write(json.dumps(result, allow_nan=False) + "\n")
            n += 1
            errors += "error" in result
    return {"lines": n, "errors": errors}
