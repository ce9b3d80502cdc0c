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
  ids, id out of range), a bad ``Content-Length``, a malformed request line
  or header;
* ``404`` another path, ``405`` another method (with ``Allow``), ``408`` a
  request not received within ``request_timeout``, ``411`` no
  ``Content-Length`` (chunked bodies are not read), ``413`` too many instances
  or a body over ``max_body_bytes``, ``414``/``431`` a request line or headers
  too large, ``505`` an HTTP version other than 1.x;
* ``503`` (with ``Retry-After``) when the server is saturated: ``max_queued``
  requests already wait for the model, or ``max_connections`` are open;
* ``500`` when the model's output holds NaN/infinity (JSON has no such number:
  the server never sends ``NaN``) or the model call fails.

The server keeps answering after any of them.

**Design: three stages, so that no client can hold up another.**

1. *Front end* (:mod:`jaxrec.inference.http_front`): one ``asyncio`` event
   loop owns every connection. Reading is non-blocking, so an idle or slow
   client (a dozen idle keep-alive connections, a slow-loris trickling its
   headers) costs a socket, not a thread; only a complete request goes on.
   Per connection: ``idle_timeout`` between requests and per read stall,
   ``request_timeout`` for a whole request, ``max_body_bytes``; in all,
   ``max_connections`` (then ``503``). HTTP/1.1 keep-alive.
2. *Decoding*: ``max_workers`` threads parse and validate bodies
   (:func:`~jaxrec.inference.request.decode_request`), off the loop, so a large
   body does not stall other connections' I/O. A bad request is answered here
   and never reaches the model. At most ``max_queued`` requests are between
   here and their answer; past that, ``503``.
3. *Dynamic batching* (:mod:`jaxrec.inference.batcher`): one thread runs the
   model on the instances of all queued requests together, up to
   ``max_batch_size`` instances, waiting at most ``batch_timeout_ms`` for more
   (0, the default: never wait, take what queued while the previous call ran),
   and gives each request its own rows back. A request whose output is not
   finite, or whose call fails, fails alone.

Each call's batch is padded to a power-of-two bucket by the loaded model, so at
most ``log2(max_batch_size) + 1`` shapes are ever compiled
(:meth:`PredictionServer.warm_up` compiles them all up front).

**Why the standard library.** The old server (``http.server`` on a bounded
thread pool) had idle connections hold its workers: with a few dozen open,
every valid request timed out. An event loop fixes that, and ``asyncio`` is
one: the HTTP/1.1 subset served here (a request line, headers, a
``Content-Length`` body, keep-alive) is a few hundred lines on it. A well-kept
server (``uvicorn``/``hypercorn`` for ASGI, ``aiohttp``) would bring more of
HTTP (chunked bodies, pipelining edge cases, HTTP/2) but also a runtime
dependency for a package whose server is a template, and their own plain-text
error pages (413, 400, 431, 503) that break the "every error is JSON" contract
here. Its limits: no TLS, no auth, no chunked request bodies, one model per
server, one process (the GIL: decoding and HTTP share a core's worth of
Python). For production, call :func:`predict_body` from the framework of your
choice (it takes the body bytes and returns a status and a JSON payload), or
put this server behind a TLS-terminating proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from pathlib import Path
from typing import Any

import numpy as np

from .artifact import ExportedModel, InputError
from .batcher import DynamicBatcher, Pending, prediction_rows
from .http_front import Answer, HttpFrontEnd, Limits, error
from .request import (
    MAX_JSON_DEPTH,
    DecodedBatch,
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
    return prediction_rows(out)


def failure(e: Exception) -> tuple[int, str]:
    """``(HTTP status, message)`` for what failed a request."""
    if isinstance(e, RequestError):
        return e.status, str(e)
    if isinstance(e, InputError):  # the model's own host-side checks
        return HTTPStatus.BAD_REQUEST, str(e)
    if isinstance(e, NonFiniteOutput):
        return HTTPStatus.INTERNAL_SERVER_ERROR, str(e)
    return HTTPStatus.INTERNAL_SERVER_ERROR, f"model call failed: {e!r}"


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
    except Exception as e:  # never let one request take the server down
        status, message = failure(e)
        return status, {"error": message}


class PredictionServer:
    """Serves an :class:`ExportedModel` over HTTP (see the module docstring).

    Args:
        model: the loaded artifact.
        host, port: where to listen (port 0: any free port; see ``url``).
        max_instances: instances allowed per request (more: 413).
        max_batch_size: the most instances in one model call, from several
            requests (capped by the model's ``max_batch_size``); 1 runs each
            request alone.
        batch_timeout_ms: how long a call may wait for more requests to fill
            its batch; 0 never waits.
        max_workers: threads decoding request bodies.
        max_queued: requests being decoded or waiting for the model; further
            ones get 503.
        max_connections: open connections; further ones get 503 and are closed.
        backlog: the listening socket's kernel queue of unaccepted connections.
        idle_timeout: seconds a keep-alive connection may wait for its next
            request, and the longest any read (or write) may stall.
        request_timeout: seconds within which a request (line, headers, body)
            must arrive once it starts.
        max_body_bytes: the largest body read (larger: 413).
        max_json_depth: the deepest nesting of the body's JSON (deeper: 400).
        quiet: do not log requests to stderr.

    Example:
        >>> server = PredictionServer(load("/tmp/art"), port=0, batch_timeout_ms=2)
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
        max_batch_size: int = 256,
        batch_timeout_ms: float = 0.0,
        max_workers: int = 4,
        max_queued: int = 1024,
        max_connections: int = 1024,
        backlog: int = 1024,
        idle_timeout: float = 5.0,
        request_timeout: float = 30.0,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_json_depth: int = MAX_JSON_DEPTH,
        quiet: bool = True,
    ):
        counts = dict(
            max_workers=max_workers,
            max_queued=max_queued,
            max_connections=max_connections,
            backlog=backlog,
        )
        for name, v in counts.items():
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if idle_timeout <= 0 or request_timeout <= 0:
            raise ValueError(f"timeouts must be positive, got {idle_timeout=}, {request_timeout=}")
        self.model = model
        self.max_instances = max_instances
        self.max_queued = int(max_queued)
        self.max_json_depth = int(max_json_depth)
        self.backlog = int(backlog)
        self.limits = Limits(
            idle_timeout=float(idle_timeout),
            request_timeout=float(request_timeout),
            max_body_bytes=int(max_body_bytes),
            max_connections=int(max_connections),
        )
        self._front = HttpFrontEnd(
            {"/predict": ("POST", self._predict), "/health": ("GET", self._health)},
            self.limits,
            quiet=quiet,
        )
        self.socket = socket.create_server((host, port), backlog=self.backlog)
        self.server_address = self.socket.getsockname()
        self._batcher = DynamicBatcher(
            model, max_batch_size=max_batch_size, batch_timeout_ms=batch_timeout_ms
        )
        self._decoders = ThreadPoolExecutor(int(max_workers), thread_name_prefix="jaxrec-decode")
        self._waiting = 0  # requests between their body and their answer (loop thread only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    # ----- state -----
    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def queued(self) -> int:
        """Requests being decoded or waiting for the model."""
        return self._waiting

    @property
    def active(self) -> int:
        """Open connections (idle ones included)."""
        return len(self._front.connections)

    @property
    def stats(self) -> dict:
        """Model calls made, the instances they carried, the largest batch, and the
        connections refused for ``max_connections``."""
        b = self._batcher
        return {
            "calls": b.calls,
            "instances": b.instances,
            "largest_batch": b.largest,
            "refused_connections": self._front.refused,
        }

    def warm_up(self) -> list[int]:
        """Compiles every batch bucket a call can use; returns their sizes.

        With the default power-of-two buckets that is 1, 2, 4, ... up to
        ``max_batch_size``; a model loaded with ``batch_buckets=None`` compiles
        per size and is not warmed.
        """
        m, cap = self.model, self._batcher.max_batch_size
        buckets = getattr(m, "buckets", None)
        if buckets == "pow2":
            sizes = [1 << i for i in range((cap - 1).bit_length() + 1)]
        elif buckets:
            sizes = sorted(s for s in buckets if s <= cap)
        else:
            sizes = []
        for b in sizes:
            empty = {k: [[] for _ in range(b)] for k in m.features}
            batch = DecodedBatch(
                np.zeros((b, m.num_dense), m.dense_dtype), empty, empty if m.weighted else None
            )
            m.run(*batch_arrays(m, batch))
        return sizes

    # ----- running -----
    def start(self) -> PredictionServer:
        """Serves in a daemon thread; returns self once it accepts connections."""
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        self._ready.wait(30)
        return self

    def serve_forever(self) -> None:
        """Serves until :meth:`shutdown` (or :meth:`stop`) from another thread."""
        if self._closed:
            raise RuntimeError("the server is closed")
        self._done.clear()
        loop = asyncio.new_event_loop()
        self._loop = loop
        main = loop.create_task(self._serve())
        try:
            loop.run_until_complete(main)
        except BaseException:  # e.g. KeyboardInterrupt: close the connections first
            main.cancel()
            with contextlib.suppress(BaseException):
                loop.run_until_complete(main)
            raise
        finally:
            loop.close()
            self._loop = None
            self._ready.set()  # a start() waiting on a failed loop returns
            self._done.set()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(
            self._front.connection, sock=self.socket, backlog=self.backlog
        )
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            tasks = list(self._front.tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for _ in range(3):  # closed transports release their sockets
                await asyncio.sleep(0)

    def shutdown(self) -> None:
        """Stops :meth:`serve_forever` and waits for it; open connections are closed."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop already closed
                return
            self._done.wait(30)

    def stop(self) -> None:
        """Stops serving, closes every connection and the socket."""
        self.shutdown()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        self.server_close()

    def server_close(self) -> None:
        """Closes the listening socket and stops the decoding and model threads."""
        if self._closed:
            return
        self._closed = True
        self.socket.close()
        self._decoders.shutdown(wait=False, cancel_futures=True)
        self._batcher.close()

    # ----- routes (on the event loop) -----
    async def _health(self, body: bytes) -> Answer:
        return Answer(HTTPStatus.OK, {"status": "ok", "manifest": public_manifest(self.model)})

    async def _predict(self, body: bytes) -> Answer:
        if self._waiting >= self.max_queued:
            return error(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"the server is busy ({self.max_queued} requests wait for the model); "
                "retry shortly",
                {"Retry-After": "1"},
            )
        self._waiting += 1
        loop = asyncio.get_running_loop()
        answered = loop.create_future()

        def done(result: list | Exception) -> None:  # on the batcher's thread
            loop.call_soon_threadsafe(_resolve, answered, result)

        try:
            result = await loop.run_in_executor(self._decoders, self._decode, body, done)
            if result is None:  # queued for the model
                result = await answered
        finally:
            self._waiting -= 1
        if isinstance(result, Exception):
            return error(*failure(result))
        return Answer(HTTPStatus.OK, {"predictions": result})

    def _decode(self, body: bytes, done) -> Exception | None:
        """On a decoding thread: queues the request for the model, or returns
        why it cannot be run."""
        try:
            batch = decode_request(
                self.model, body, max_instances=self.max_instances, max_depth=self.max_json_depth
            )
            arrays = batch_arrays(self.model, batch)
        except Exception as e:
            return e
        self._batcher.submit(Pending(arrays, batch.dense.shape[0], done))
        return None


def _resolve(future: asyncio.Future, result: list | Exception) -> None:
    if not future.done():
        future.set_result(result)


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
