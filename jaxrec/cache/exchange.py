"""Bytes between every pair of processes, for the cache's planning across processes.

Over TCP connections of its own between every pair of processes; their addresses
go through ``jax.distributed``'s key-value store once. Not a device collective: a
pipeline prepares batches on its own thread while steps run, and a device collective
issued there could be ordered differently on each process than the step's own
collectives, and hang. Not the key-value store itself: it carried ~25 MB/s between
two processes on one machine (a 2.6 MB batch of ids: ~108 ms).
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
from jax._src import distributed  # the client of jax.distributed.initialize

_HEADER = 8  # payload length, big-endian


class Peers:
    """A connection to every other process (made at once by every process, under one
    ``tag``); :meth:`exchange` sends each process its own bytes and receives theirs,
    :meth:`allgather` the same bytes to all."""

    def __init__(self, tag: str, timeout_s: float):
        self.n, self.me = jax.process_count(), jax.process_index()
        self.timeout_s = timeout_s
        self.conns: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._failed: str | None = None  # a failed exchange leaves the streams mid-message
        self._pool: ThreadPoolExecutor | None = None
        if self.n == 1:
            return
        client = distributed.global_state.client
        if client is None:
            raise RuntimeError(
                "several processes but no jax.distributed client: call "
                "jax.distributed.initialize first"
            )
        ms = int(timeout_s * 1000)
        with socket.create_server(("", 0)) as server:
            server.settimeout(timeout_s)
            client.key_value_set(f"{tag}/addr/{self.me}", f"{_address()}:{server.getsockname()[1]}")
            for j in range(self.me + 1, self.n):  # connect to the later ones
                host, port = client.blocking_key_value_get(f"{tag}/addr/{j}", ms).rsplit(":", 1)
                conn = socket.create_connection((host, int(port)), timeout=timeout_s)
                conn.sendall(self.me.to_bytes(4, "big"))
                self.conns[j] = conn
            for _ in range(self.me):  # the earlier ones connect to this one
                conn, _ = server.accept()
                conn.settimeout(timeout_s)
                self.conns[int.from_bytes(_read(conn, 4), "big")] = conn
        for conn in self.conns.values():
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # a thread per connection and direction: no process waits on another's order
        self._pool = ThreadPoolExecutor(2 * (self.n - 1), thread_name_prefix="jaxrec-peers")

    def allgather(self, payload: bytes, what: str) -> list[bytes]:
        """Every process's ``payload``, in process order (each must call it in turn)."""
        return self.exchange([payload] * self.n, what)

    def exchange(self, payloads: list[bytes], what: str) -> list[bytes]:
        """Sends ``payloads[j]`` to process ``j``; returns what each process sent this
        one, in process order (``payloads[me]`` for itself; each must call it in turn).
        After a failure every later call raises: a message half read or sent would be
        read as the next one."""
        if len(payloads) != self.n:
            raise ValueError(
                f"exchange takes a payload per process ({self.n}), got {len(payloads)}"
            )
        if self.n == 1:
            return list(payloads)
        pool = self._pool  # made by __init__ with several processes
        if pool is None:
            raise RuntimeError("Peers: no connections to the other processes")
        with self._lock:
            if self._failed is not None:
                raise RuntimeError(
                    f"the exchange between processes failed earlier "
                    f"({self._failed}): restart the job's processes"
                )
            sends = [
                pool.submit(c.sendall, len(payloads[j]).to_bytes(_HEADER, "big") + payloads[j])
                for j, c in self.conns.items()
            ]
            recvs = {j: pool.submit(_message, c) for j, c in self.conns.items()}
            out = [payloads[self.me]] * self.n
            try:
                for j, f in recvs.items():
                    try:
                        out[j] = f.result()
                    except (OSError, EOFError) as e:
                        raise TimeoutError(
                            f"process {j} sent nothing for {what} within {self.timeout_s} s "
                            f"or closed its connection: did it stop, or prepare other batches "
                            f"than this process? ({type(e).__name__}: {e})"
                        ) from None
                for f in sends:
                    f.result()
            except BaseException as e:
                self._failed = f"{what}: {e}"
                for c in self.conns.values():  # the peers see it at once, not at a timeout
                    c.close()
                raise
        return out

    def close(self) -> None:
        """Closes the connections (the peers see it at once) and stops the threads; every
        later call raises."""
        with self._lock:
            self._failed = self._failed or "closed by this process"
            for c in self.conns.values():
                c.close()
            if self._pool is not None:
                self._pool.shutdown(wait=False)


def _message(conn: socket.socket) -> bytes:
    return _read(conn, int.from_bytes(_read(conn, _HEADER), "big"))


def _read(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if not k:
            raise EOFError("connection closed")
        got += k
    return bytes(buf)


def _address() -> str:
    """This host's address as the other processes reach it: the one its packets to the
    coordinator leave from (a UDP connect sends nothing)."""
    coordinator = distributed.global_state.coordinator_address
    if coordinator is None:
        raise RuntimeError(
            "several processes but no jax.distributed coordinator: call "
            "jax.distributed.initialize first"
        )
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 1))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())
