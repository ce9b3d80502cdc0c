"""A non-blocking HTTP/1.1 front end: reads whole requests on one event loop.

Every connection is a coroutine on one ``asyncio`` loop: an idle or slow
client costs a socket and a few kilobytes, never a thread, so it cannot hold
up anyone else's request. Only a complete request (line, headers and a body
of at most ``max_body_bytes``) reaches a route's handler. What a connection
may do is bounded:

* the next request must start within ``idle_timeout`` and no read may stall
  longer; once its first byte arrived a request must be whole within
  ``request_timeout`` (else ``408``, or a silent close for an idle one);
* a request line or header line of at most 64 KiB (``414`` / ``431``), at most
  100 headers (``431``), a ``Content-Length`` (``411`` without one on a POST,
  chunked bodies are not read) of at most ``max_body_bytes`` (``413``, also
  before a ``100 Continue``);
* at most ``max_connections`` open connections: the next ones get a ``503``
  and are closed;
* an answer must be taken by the client within ``idle_timeout``.

Errors are JSON ``{"error": ...}``. After an error that leaves request bytes
unread, the connection is half-closed and drained (bounded by bytes and 2 s)
so that the answer is not lost to a TCP reset. HTTP/1.1 connections are kept
alive unless the client sends ``Connection: close`` (HTTP/1.0: only with
``Connection: keep-alive``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import NamedTuple
from urllib.parse import urlsplit

MAX_LINE = 65536  # as http.server: a longer request line is 414, header line 431
MAX_HEADERS = 100
MAX_ERROR_CHARS = 1000  # an error message echoes request keys: keep answers small
KNOWN_METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH")  # others: 405 without Allow
_DRAIN_BYTES = 64 << 20  # what an answered, refused client may still send
_READ = 1 << 16


class Answer(NamedTuple):
    """A JSON answer: status, payload, extra headers."""

    status: int
    payload: Mapping
    headers: Mapping[str, str] = {}


Handler = Callable[[bytes], Awaitable[Answer]]  # the body in, an answer out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """What one connection may do (see the module docstring)."""

    idle_timeout: float = 5.0
    request_timeout: float = 30.0
    max_body_bytes: int = 8 << 20
    max_connections: int = 1024


class _Closed(Exception):
    """The connection is done: close it without an answer."""


class _Refuse(Exception):
    """Answer ``status`` with ``message`` and close (draining what is unread)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Answer:
    return Answer(status, {"error": message}, headers or {})


class HttpFrontEnd:
    """Serves ``routes`` (``{path: (method, handler)}``) on one event loop.

    A route with method ``POST`` gets the request body; other methods' bodies
    are read and dropped. Call :meth:`serve` from a coroutine; the loop's
    thread runs nothing slow (handlers hand work to other threads).
    """

    def __init__(
        self,
        routes: Mapping[str, tuple[str, Handler]],
        limits: Limits,
        *,
        quiet: bool = True,
    ):
        self.routes = dict(routes)
        self.limits = limits
        self.quiet = quiet
        self.connections: set[asyncio.Task] = set()  # served (counted for max_connections)
        self.tasks: set[asyncio.Task] = set()  # every connection's, refused ones too
        self.refused = 0  # connections answered 503 for max_connections, in all
        self.refusing = 0  # ... being answered now

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """``asyncio.start_server``'s callback: one connection, request after request."""
        task = asyncio.current_task()
        assert task is not None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # headers and body go out in one write, but a client's delayed ACK
            # must never hold an answer back
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Connection(self, reader, writer)
        self.tasks.add(task)
        try:
            if len(self.connections) < self.limits.max_connections:
                self.connections.add(task)
                await conn.run()
            elif self.refusing < self.limits.max_connections:  # even refusals are bounded
                self.refused += 1
                self.refusing += 1
                try:
                    await conn.refuse_busy()
                finally:
                    self.refusing -= 1
            else:
                self.refused += 1
                writer.transport.abort()
        finally:
            self.connections.discard(task)
            self.tasks.discard(task)

    def log(self, message: str) -> None:
        if not self.quiet:
            sys.stderr.write(f"[{formatdate(time.time(), localtime=True)}] {message}\n")


class _Connection:
    def __init__(self, front: HttpFrontEnd, reader, writer):
        self.front, self.limits = front, front.limits
        self.reader, self.writer = reader, writer
        self.buf = bytearray()
        self.deadline: float | None = None  # the current request's, from its first byte
        peer = writer.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else str(peer)

    # ----- reading -----
    async def _fill(self) -> None:
        """Reads more bytes into ``buf``; TimeoutError when a limit passes."""
        timeout = self.limits.idle_timeout
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 0:
                raise TimeoutError(
                    f"the request did not arrive within {self.limits.request_timeout:g} s"
                )
        try:
            async with asyncio.timeout(timeout):
                data = await self.reader.read(_READ)
        except TimeoutError:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise TimeoutError(
                    f"the request did not arrive within {self.limits.request_timeout:g} s"
                ) from None
            raise TimeoutError(f"no data for {self.limits.idle_timeout:g} s") from None
        if not data:
            raise EOFError
        if self.deadline is None:
            self.deadline = time.monotonic() + self.limits.request_timeout
        self.buf += data

    async def _line(self, too_long: tuple[int, str]) -> bytes:
        start = 0
        while True:
            i = self.buf.find(b"\n", start)
            if 0 <= i <= MAX_LINE:
                line = bytes(self.buf[: i + 1])
                del self.buf[: i + 1]
                return line
            if len(self.buf) > MAX_LINE:
                raise _Refuse(*too_long)
            start = len(self.buf)
            await self._fill()

    async def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._fill()
        body = bytes(self.buf[:n])
        del self.buf[:n]
        return body

    # ----- one connection -----
    async def run(self) -> None:
        try:
            while await self._one_request():
                pass
        except (_Closed, EOFError, ConnectionError, TimeoutError):
            pass
        except asyncio.CancelledError:  # the server stops
            pass
        finally:
            self.writer.transport.close()

    async def _one_request(self) -> bool:
        """Reads and answers one request; whether to keep the connection."""
        self.deadline = None if not self.buf else time.monotonic() + self.limits.request_timeout
        try:
            line = b"\r\n"
            while line in (b"\r\n", b"\n"):  # empty lines before a request are ignored
                line = await self._line((HTTPStatus.REQUEST_URI_TOO_LONG, "Request-URI Too Long"))
            request = await self._head(line)
        except TimeoutError as e:
            if self.deadline is None:  # idle: no request started
                raise _Closed from None
            await self._finish(error(HTTPStatus.REQUEST_TIMEOUT, f"the request timed out: {e}"))
            raise _Closed from None
        except EOFError:
            raise _Closed from None
        except _Refuse as e:
            await self._finish(error(e.status, str(e)))
            raise _Closed from None
        answer, keep = await self._route(request)
        if keep is None:  # not understood or unread bytes: answer, drain, close
            await self._finish(answer)
            return False
        keep = keep and request.keep_alive
        await self._send(answer, close=not keep, line=request.line)
        return keep

    async def _head(self, line: bytes) -> _Request:
        text = line.decode("iso-8859-1").rstrip("\r\n")
        words = text.split()
        if len(words) != 3:
            raise _Refuse(HTTPStatus.BAD_REQUEST, f"Bad request syntax ({text!r})")
        method, target, version = words
        try:
            if not version.startswith("HTTP/"):
                raise ValueError
            major, minor = (int(x) for x in version[5:].split(".", 1))
        except ValueError:
            raise _Refuse(HTTPStatus.BAD_REQUEST, f"Bad request version ({version!r})") from None
        if major != 1:
            raise _Refuse(
                HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"Invalid HTTP version ({version})"
            )
        headers: dict[str, list[str]] = {}
        last = None
        for count in range(MAX_HEADERS + 1):
            raw = await self._line((HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Line too long"))
            if raw in (b"\r\n", b"\n"):
                break
            if count == MAX_HEADERS:
                raise _Refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Too many headers")
            h = raw.decode("iso-8859-1").rstrip("\r\n")
            if h[:1] in (" ", "\t") and last is not None:  # obsolete line folding
                headers[last][-1] += " " + h.strip()
                continue
            name, colon, value = h.partition(":")
            if not colon or not name or name != name.strip():
                raise _Refuse(HTTPStatus.BAD_REQUEST, f"Bad header line {h!r:.80}")
            last = name.lower()
            headers.setdefault(last, []).append(value.strip())
        conn = ",".join(headers.get("connection", ())).lower()
        keep = "close" not in conn if minor >= 1 else "keep-alive" in conn
        return _Request(text, method, target, (major, minor), headers, keep)

    async def _route(self, r: _Request) -> tuple[Answer, bool | None]:
        """The answer, and whether the connection may stay (None: answer, drain, close)."""
        path = urlsplit(r.target).path
        if r.method not in KNOWN_METHODS:
            return error(HTTPStatus.METHOD_NOT_ALLOWED, f"method {r.method!r} not allowed"), None
        route = self.front.routes.get(path)
        wants_body = route is not None and route[0] == r.method == "POST"
        err = self._length_error(r, path, wants_body)
        if r.version >= (1, 1) and "100-continue" in ",".join(r.headers.get("expect", ())).lower():
            if err is not None:  # refused before the client sends the body
                return error(*err), None
            await self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if wants_body and route is not None:  # route: narrowed for the type checker
            if err is not None:
                return error(*err), None
            n = int(r.headers["content-length"][0])
            try:
                body = await self._exactly(n)
            except TimeoutError as e:
                late = f"the body did not arrive in time: {e}"
                return error(HTTPStatus.REQUEST_TIMEOUT, late), None
            except EOFError:
                got = len(self.buf)
                return (
                    error(HTTPStatus.BAD_REQUEST, f"body of {got} bytes; Content-Length is {n}"),
                    False,
                )
            return await _call(route[1], body), True
        keep: bool | None = True
        if err is not None:
            keep = None
        else:
            n = int((r.headers.get("content-length") or ["0"])[0])
            try:
                await self._exactly(n)
            except (TimeoutError, EOFError):
                keep = False
        if route is None:
            return (
                error(HTTPStatus.NOT_FOUND, f"no such path {path!r}; use {_uses(self.front)}"),
                keep,
            )
        if r.method != route[0]:
            return (
                error(
                    HTTPStatus.METHOD_NOT_ALLOWED,
                    f"{r.method} {path} is not allowed; use {route[0]} {path}",
                    {"Allow": route[0]},
                ),
                keep,
            )
        return await _call(route[1], b""), keep

    def _length_error(self, r: _Request, path: str, needed: bool) -> tuple[int, str] | None:
        """Why the body cannot be read (status, message), or None."""
        if "chunked" in ",".join(r.headers.get("transfer-encoding", ())).lower():
            return HTTPStatus.LENGTH_REQUIRED, "chunked bodies are not read; send Content-Length"
        values = r.headers.get("content-length") or []
        if not values:
            if needed:
                why = f"{r.method} {path} needs a Content-Length header"
                return HTTPStatus.LENGTH_REQUIRED, why
            return None
        if len(set(values)) > 1 or not values[0].isdigit():
            return HTTPStatus.BAD_REQUEST, f"bad Content-Length header {values!r:.80}"
        n, limit = int(values[0]), self.limits.max_body_bytes
        if n > limit:
            why = f"body of {n} bytes; at most {limit} allowed"
            return HTTPStatus.REQUEST_ENTITY_TOO_LARGE, why
        return None

    # ----- writing -----
    async def _write(self, data: bytes) -> None:
        self.writer.write(data)
        if self.writer.transport.get_write_buffer_size():  # the client is not reading
            async with asyncio.timeout(self.limits.idle_timeout):
                await self.writer.drain()

    async def _send(self, answer: Answer, *, close: bool, line: str = "-") -> None:
        status, payload, headers = answer
        if "error" in payload and len(payload["error"]) > MAX_ERROR_CHARS:
            payload = {"error": payload["error"][:MAX_ERROR_CHARS] + " ..."}
        try:
            body = json.dumps(payload, allow_nan=False).encode()
        except ValueError as e:  # a NaN that got past the output check
            status, body = 500, json.dumps({"error": f"unserializable answer: {e}"}).encode()
        head = [
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
            "Server: jaxrec",
            f"Date: {formatdate(usegmt=True)}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        if close:
            head.append("Connection: close")
        await self._write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        self.front.log(f'{self.peer} "{line}" {status}')

    async def _finish(self, answer: Answer) -> None:
        """Answers, half-closes, then reads what the client still sends (bounded),
        so that the answer is not lost to a reset (closing with unread data sends
        a TCP RST)."""
        with contextlib.suppress(OSError, TimeoutError):
            await self._send(answer, close=True)
            if self.writer.can_write_eof():
                self.writer.write_eof()
            end = time.monotonic() + 2.0
            n, most = 0, max(4 * self.limits.max_body_bytes, _DRAIN_BYTES)
            while n < most:
                left = end - time.monotonic()
                if left <= 0:
                    break
                async with asyncio.timeout(min(left, 0.5)):
                    chunk = await self.reader.read(_READ)
                if not chunk:
                    break
                n += len(chunk)

    async def refuse_busy(self) -> None:
        """A connection over ``max_connections``: 503 and close."""
        try:
            await self._finish(
                error(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    "the server is busy (too many open connections); retry shortly",
                    {"Retry-After": "1"},
                )
            )
        except asyncio.CancelledError:
            pass
        finally:
            self.writer.transport.close()


class _Request(NamedTuple):
    line: str
    method: str
    target: str
    version: tuple[int, int]
    headers: dict[str, list[str]]  # lower-case names
    keep_alive: bool


async def _call(handler: Handler, body: bytes) -> Answer:
    try:
        return await handler(body)
    except Exception as e:  # never let one request take the connection down
        return error(HTTPStatus.INTERNAL_SERVER_ERROR, f"the request failed: {e!r}")


def _uses(front: HttpFrontEnd) -> str:
    return " or ".join(f"{m} {p}" for p, (m, _) in front.routes.items())
