"""A watchdog that stops every process of a run as soon as one of them dies.

When a process dies mid-run (killed, out of memory, a crash), the others block
in their next collective: gloo does not fail a collective that spans several
devices per process when a peer's connection closes, and JAX's coordination
service ends them only after its heartbeat timeout (100 s by default), with a
wall of C++ log lines. The watchdog notices at once: every process keeps one
TCP connection to process 0, and the kernel closes a dead process's connection
the moment it dies. Process 0 then tells every other process which one was lost,
and each calls ``on_lost`` (by default: one line on stderr, then exit 75).

A process that ends normally says so first (:func:`stop_watching`), so a run
whose processes finish at different times is not mistaken for a failure. A host
that vanishes without closing its connections (power loss, a network
partition) is not seen here: the heartbeat timeout still ends the others.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import sys
import threading
import warnings
from collections.abc import Callable

from jax._src import distributed  # the runtime's client (its key-value store)

from . import peers

PEER_LOST = 75  # exit status after another process was lost (sysexits' EX_TEMPFAIL)
_PORT_KEY = "jaxrec/watchdog_port"
_SETUP_TIMEOUT_S = 60

# on_lost(process id, its address, "stopped responding" | "failed with an error")
LostCallback = Callable[[int, str, str], None]

_state: dict = {}  # "sockets", "stopped" (a threading.Event), "me"


def watch_processes(on_lost: LostCallback | None = None) -> bool:
    """Starts the watchdog (after :func:`~jaxrec.distributed.initialize`; every
    process calls it). ``on_lost(process, address, how)`` runs on a watchdog
    thread once, when another process dies or fails; by default it prints
    ``error: process 1 (10.0.0.2) stopped responding ...`` and exits with
    ``PEER_LOST``. Does nothing with one process or when already watching.

    Process 0 listens on a free port of every interface; the others connect to
    it at the coordinator's host. Where they cannot (a firewall that opens only
    the coordinator's port), every process warns and runs without a watchdog
    (the heartbeat timeout still applies).

    Returns:
        Whether the watchdog runs.
    """
    client, n = distributed.global_state.client, distributed.global_state.num_processes
    if client is None or n is None or n < 2 or _state:
        return bool(_state)
    me = distributed.global_state.process_id
    try:
        sockets = _connect(client, me, n)
    except (OSError, ValueError, RuntimeError) as e:  # (the store's timeout: RuntimeError)
        warnings.warn(
            f"process {me}: no watchdog ({e}); a lost process stops the others only after "
            "the heartbeat timeout",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    on_lost = on_lost or _exit_on_lost
    stopped = threading.Event()
    if me == 0:
        target = lambda: _watch_others(sockets, stopped, on_lost)  # noqa: E731
    else:
        target = lambda: _watch_first(sockets[0], stopped, on_lost)  # noqa: E731
    _state.update(sockets=list(sockets.values()), stopped=stopped, me=me)
    threading.Thread(target=target, name="jaxrec-watchdog", daemon=True).start()
    return True


def _connect(client, me: int, n: int) -> dict[int, socket.socket]:
    """The watchdog's connections, by the process at their other end: process 0 has
    one to every other process, which each have one to process 0. Every connection
    is acknowledged ("OK") only once process 0 has them all, so that a setup that
    fails half-way stops no process."""
    if me == 0:
        if socket.has_dualstack_ipv6():
            server = socket.create_server(
                ("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=n
            )
        else:
            server = socket.create_server(("", 0), backlog=n)
        conns: dict[int, socket.socket] = {}
        try:
            with server:
                server.settimeout(_SETUP_TIMEOUT_S)
                client.key_value_set(_PORT_KEY, str(server.getsockname()[1]))
                for _ in range(n - 1):
                    conn, _ = server.accept()
                    conn.settimeout(_SETUP_TIMEOUT_S)
                    conns[int(_read_line(conn))] = conn
            for conn in conns.values():
                conn.sendall(b"OK\n")
                conn.settimeout(None)
        except BaseException:
            for conn in conns.values():
                conn.close()
            raise
        return conns
    port = int(client.blocking_key_value_get(_PORT_KEY, _SETUP_TIMEOUT_S * 1000))
    host = (distributed.global_state.coordinator_address or "").rpartition(":")[0]
    conn = socket.create_connection((host.strip("[]"), port), timeout=_SETUP_TIMEOUT_S)
    try:
        conn.sendall(f"{me}\n".encode())
        if _read_line(conn) != "OK":
            raise OSError("process 0 did not acknowledge the connection")
    except BaseException:
        conn.close()
        raise
    conn.settimeout(None)
    return {0: conn}


def stop_watching(ok: bool = True) -> None:
    """Tells the other processes that this one ends: normally (``ok``), or with an
    error (they stop too: they cannot go on without it). Call it on every exit
    path of a watched run; a no-op when not watching."""
    if not _state or _state["stopped"].is_set():
        return
    _state["stopped"].set()
    word = b"DONE\n" if ok else b"FAIL\n"
    for s in _state["sockets"]:  # (the watchdog thread closes them when their peer does)
        with contextlib.suppress(OSError):
            s.sendall(word)
            s.shutdown(socket.SHUT_WR)


def _watch_others(conns: dict[int, socket.socket], stopped, on_lost) -> None:
    """Process 0: the first connection that closes or says FAIL is the lost process;
    every other process hears of it."""
    selector = selectors.DefaultSelector()
    for i, conn in conns.items():
        selector.register(conn, selectors.EVENT_READ, i)
    live = dict(conns)
    try:
        while live:
            for key, _ in selector.select():
                i, word = key.data, _read_word(live[key.data])
                selector.unregister(key.fileobj)
                live.pop(i).close()
                if word == "DONE" or stopped.is_set():
                    continue
                for other in live.values():
                    with contextlib.suppress(OSError):
                        other.sendall(f"LOST {i} {word == 'FAIL'}\n".encode())
                how = "failed with an error" if word == "FAIL" else "stopped responding"
                on_lost(i, peers.address_of(i), how)
                return
    finally:
        selector.close()
        for conn in live.values():
            conn.close()


def _watch_first(conn: socket.socket, stopped, on_lost) -> None:
    """Another process: process 0 closing (or failing) is the loss of process 0; its
    LOST message names another."""
    with conn:
        line = _read_word(conn)
    if line == "DONE" or stopped.is_set():
        return
    lost, failed = 0, line == "FAIL"
    if line.startswith("LOST "):
        _, i, f = line.split()
        lost, failed = int(i), f == "True"
    how = "failed with an error" if failed else "stopped responding"
    on_lost(lost, peers.address_of(lost), how)


def _exit_on_lost(process: int, address: str, how: str) -> None:
    sys.stdout.flush()
    print(f"error: process {process} ({address}) {how}", file=sys.stderr, flush=True)
    os._exit(PEER_LOST)


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _read_word(conn: socket.socket) -> str:
    """The line ``conn`` sends, ``""`` when it closes or fails first."""
    try:
        return _read_line(conn)
    except OSError:
        return ""
