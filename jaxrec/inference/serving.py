"""A minimal HTTP prediction server and a JSONL batch mode for exported artifacts.

Stdlib only (``http.server.ThreadingHTTPServer``), meant for loopback tests,
demos and as a template, not for production traffic (no TLS, no auth, no
cross-request batching).

Endpoints:

``POST /predict`` with ``Content-Type: application/json``::

    {"instances": [{"dense": [0.1, 0.2, ...],            # num_dense floats
                    "sparse": {"f1": [3, 17], "f2": []}}, # every feature, ids
                   ...]}                                  # <= max_instances

answers ``200 {"predictions": [p0, p1, ...]}``: one entry per instance, a
number when the model has one output per sample, else a (nested) list.
Invalid requests get a ``4xx`` with ``{"error": "<what is wrong>"}``: ``400``
for bad JSON or a bad instance (unknown or missing feature, wrong type, too
many ids, id out of range, wrong dense width), ``413`` for too many instances
or too large a body, ``404``/``405`` for other paths/methods. The server keeps
answering after any of them.

``GET /health`` answers ``200 {"status": "ok", "manifest": {...}}`` (the
artifact's manifest without its weight list).

Each request's batch is padded to a power-of-two bucket by the loaded model,
so at most ``log2(max_instances) + 1`` shapes are ever compiled.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from .artifact import ExportedModel, InputError

MAX_BODY_BYTES = 8 << 20


class RequestTooLarge(InputError):
    """Too many instances or too large a body (HTTP 413)."""


def public_manifest(model: ExportedModel) -> dict:
    """The manifest without the weight file list."""
    return {k: v for k, v in model.manifest.items() if k != "weights"}


def parse_instances(
    model: ExportedModel, instances: Any, max_instances: int | None = None
) -> tuple[np.ndarray, dict]:
    """``(dense [B, N], {feature: [ids per sample]})`` from request instances.

    Raises:
        InputError: a malformed instance (the message names the instance and field).
        RequestTooLarge: more than ``max_instances`` instances.
    """
    if not isinstance(instances, list):
        raise InputError(f"'instances' must be a list, got {type(instances).__name__}")
    if not instances:
        raise InputError("'instances' is empty")
    if max_instances is not None and len(instances) > max_instances:
        raise RequestTooLarge(
            f"{len(instances)} instances in one request; at most {max_instances} allowed"
        )
    dense, sparse = [], {k: [] for k in model.features}
    for i, inst in enumerate(instances):
        if not isinstance(inst, Mapping):
            raise InputError(f"instance {i} must be an object, got {type(inst).__name__}")
        extra = sorted(set(inst) - {"dense", "sparse"})
        if extra:
            raise InputError(f"instance {i}: unknown field(s) {extra}; use 'dense' and 'sparse'")
        d = inst.get("dense", [] if model.num_dense == 0 else None)
        if not isinstance(d, list) or any(
            isinstance(x, bool) or not isinstance(x, int | float) for x in d
        ):
            raise InputError(f"instance {i}: 'dense' must be a list of {model.num_dense} numbers")
        if len(d) != model.num_dense:
            raise InputError(
                f"instance {i}: 'dense' has {len(d)} values; the model takes {model.num_dense}"
            )
        s = inst.get("sparse")
        if not isinstance(s, Mapping):
            raise InputError(f"instance {i}: 'sparse' must be an object {{feature: [ids]}}")
        try:
            model.check_features(list(s))
        except InputError as e:
            raise InputError(f"instance {i}: {e}") from None
        dense.append(d)
        for k in model.features:
            sparse[k].append(s[k])
    return np.asarray(dense, np.float32).reshape(len(instances), model.num_dense), sparse


def predict_instances(
    model: ExportedModel, instances: Any, max_instances: int | None = None
) -> list:
    """Predictions (JSON-able) for request instances; raises :class:`InputError`."""
    dense, sparse = parse_instances(model, instances, max_instances)
    out = model(dense, sparse)
    return [_jsonable(row) for row in out]


def _jsonable(row: np.ndarray) -> Any:
    return float(row.reshape(())) if row.size == 1 else row.tolist()


class PredictionServer(ThreadingHTTPServer):
    """Serves an :class:`ExportedModel` over HTTP (see the module docstring).

    Args:
        model: the loaded artifact.
        host, port: where to listen (port 0: any free port; see ``url``).
        max_instances: instances allowed per request.
        quiet: do not log requests to stderr.

    Example:
        >>> server = PredictionServer(load("/tmp/art"), port=0)
        >>> server.start()            # background thread
        >>> server.url                # 'http://127.0.0.1:<port>'
        >>> server.stop()
    """

    daemon_threads = True

    def __init__(
        self,
        model: ExportedModel,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        max_instances: int = 256,
        quiet: bool = True,
    ):
        self.model = model
        self.max_instances = max_instances
        self.quiet = quiet
        self._thread: threading.Thread | None = None
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> PredictionServer:
        """Serves in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and closes the socket."""
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join()


class _Handler(BaseHTTPRequestHandler):
    server: PredictionServer
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections
    # TCP_NODELAY: headers and body go out in two writes; with Nagle on, the body
    # waits for the client's delayed ACK (~40 ms a request on Linux loopback).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (stdlib signature)
        if not self.server.quiet:
            super().log_message(format, *args)

    def _send(self, status: int, payload: Mapping) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (stdlib name)
        if self.path != "/health":
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}"})
            return
        self._send(HTTPStatus.OK, {"status": "ok", "manifest": public_manifest(self.server.model)})

    def do_POST(self) -> None:  # noqa: N802 (stdlib name)
        if self.path != "/predict":
            self._drain()
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}"})
            return
        try:
            payload = self._json_body()
            if not isinstance(payload, dict) or "instances" not in payload:
                raise InputError('the body must be a JSON object {"instances": [...]}')
            preds = predict_instances(
                self.server.model, payload["instances"], self.server.max_instances
            )
        except RequestTooLarge as e:
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": str(e)})
        except InputError as e:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(e)})
        except Exception as e:  # never let one request take the server down
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(e).__name__}: {e}"})
        else:
            self._send(HTTPStatus.OK, {"predictions": preds})

    def do_PUT(self) -> None:  # noqa: N802 (stdlib name)
        self._drain()
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, {"error": "use POST /predict or GET /health"})

    do_DELETE = do_PATCH = do_PUT  # noqa: N815

    def _drain(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        if 0 < n <= MAX_BODY_BYTES:
            self.rfile.read(n)
        elif n:
            self.close_connection = True

    def _json_body(self) -> Any:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise InputError("bad Content-Length header") from None
        if n > MAX_BODY_BYTES:
            self.close_connection = True  # the body is not read: drop the connection
            raise RequestTooLarge(f"body of {n} bytes; at most {MAX_BODY_BYTES} allowed")
        raw = self.rfile.read(n)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"the body is not valid JSON: {e}") from None


def predict_jsonl(
    model: ExportedModel,
    lines: Iterable[str],
    *,
    batch_size: int = 64,
) -> Iterable[dict]:
    """Batch mode: one instance per JSON line in, one result per line out.

    Each output line is ``{"prediction": ...}`` or, for an invalid line,
    ``{"error": "..."}`` (the other lines of its batch are still predicted).
    """
    batch: list[tuple[int, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            batch.append((i, json.loads(line)))
        except json.JSONDecodeError as e:
            batch.append((i, InputError(f"line {i + 1} is not valid JSON: {e}")))
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
    except InputError:  # find the bad lines one by one
        preds = {}
        for i, x in good:
            try:
                preds[i] = predict_instances(model, [x])[0]
            except InputError as e:
                preds[i] = InputError(f"line {i + 1}: {e}")
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
            dst.write(json.dumps(result) + "\n")
            n += 1
            errors += "error" in result
    return {"lines": n, "errors": errors}
