"""The other processes of a multi-process run: where gloo reaches them, and which
one a failed collective lost.

JAX's CPU collectives (gloo) bind each process to the address its host name
resolves to (``gethostname()``); JAX 0.10 has no setting for it, and a host whose
name resolves to ``127.0.1.1`` (Debian's ``/etc/hosts``) advertises an address no
other host reaches, so the first collective times out. :func:`use_gloo_interface`
binds gloo to a named interface instead (``GLOO_SOCKET_IFNAME``, the variable
PyTorch's gloo backend reads).

When a process dies (killed, its host lost), a peer blocked in a collective with
it gets gloo's error naming the dead peer's address ("Connection closed by peer
[10.0.0.2]:41234"); :func:`lost_process` turns that into the process id, from
the table :func:`publish_address` exchanged at start. A process waiting outside
a collective (a checkpoint commit) is ended by JAX's coordination service after
its heartbeat timeout instead (``jax.distributed.initialize``'s
``heartbeat_timeout_seconds``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct
import warnings

from jax._src import distributed, xla_bridge  # the runtime's client; the CPU backend

# make_gloo_tcp_collectives (gloo with a chosen interface) exists only in the private
# module: jax has no public way to bind the CPU collectives to an interface.
from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]

_KEY = "jaxrec/process_address/{}"
_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address
_addresses: dict[int, str] = {}  # process id -> the address its collectives use


def use_gloo_interface(interface: str) -> None:
    """Binds this process's gloo CPU collectives to ``interface`` (e.g. ``"eth0"``).

    Call it before JAX's CPU backend starts: it replaces the CPU backend's
    factory by one that passes the interface to gloo (JAX itself passes none, so
    gloo uses the host name) with the client of ``jax.distributed.initialize``.

    Raises:
        ValueError: this host has no interface ``interface``.
        RuntimeError: the CPU backend already started.
    """
    try:
        socket.if_nametoindex(interface)
    except OSError:
        names = ", ".join(name for _, name in socket.if_nameindex())
        raise ValueError(
            f"gloo interface {interface!r} (GLOO_SOCKET_IFNAME) is not on this host; it has {names}"
        ) from None
    registration = xla_bridge._backend_factories["cpu"]

    def make_cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, interface=interface
        )
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory(
        "cpu",
        make_cpu_client,
        priority=registration.priority,
        fail_quietly=registration.fail_quietly,
    )


def publish_address(interface: str | None = None) -> None:
    """Exchanges, through the coordination service, the address each process's
    collectives use (``interface``'s, else its host name's): :func:`lost_process`
    names a lost peer from it. Warns when gloo would advertise a loopback address
    while the coordinator is not on loopback (the other hosts could not reach it)."""
    address = _interface_address(interface) if interface else _host_address()
    coordinator = distributed.global_state.coordinator_address or ""
    coordinator_host = coordinator.rpartition(":")[0].strip("[]")
    if _loopback(address) and coordinator_host and not _loopback(coordinator_host):
        warnings.warn(
            f"this host's name {socket.gethostname()!r} resolves to {address}: gloo binds "
            "there, and no other host reaches it. Set GLOO_SOCKET_IFNAME to the interface "
            "the other hosts reach (e.g. eth0)",
            RuntimeWarning,
            stacklevel=3,
        )
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("publish_address needs jax.distributed.initialize to have run first")
    # (not jax.process_index(): that would start the backend before its settings)
    me, n = distributed.global_state.process_id, distributed.global_state.num_processes
    client.key_value_set(_KEY.format(me), address)
    for i in range(n):
        _addresses[i] = client.blocking_key_value_get(_KEY.format(i), 60_000)


def address_of(process: int) -> str:
    """The address process ``process``'s collectives use (``"?"`` when unknown)."""
    return _addresses.get(process, "?")


def lost_process(error: BaseException) -> str | None:
    """A one-line description of the peer ``error`` says a collective lost
    ("process 1 (10.0.0.2) stopped responding: ..."), or ``None`` when ``error`` is
    not a failed cross-process collective."""
    text = str(error)
    match = re.search(r"Gloo [^\n]*? failed: ?(.*)", text)
    if match is None or "initialization failed" in match.group(0):
        return None  # (a connection that never worked: an address, not a lost process)
    reason = re.sub(r"^\[[^\]]*\]\s*", "", match.group(1).strip())  # gloo's source line
    # the peer's address: "peer [a]:p", "remote=[a]:p", "Read error [a]:p" (not "local=")
    found = [
        m.group(2) for m in re.finditer(r"(local=)?\[([0-9A-Fa-f.:]+)\]", text) if not m.group(1)
    ]
    if not found:
        return f"a process stopped responding: {reason}"
    address, me = found[0], distributed.global_state.process_id
    ids = sorted(i for i, a in _addresses.items() if a == address and i != me)
    if len(ids) == 1:
        who = f"process {ids[0]} ({address})"
    elif ids:
        who = f"one of processes {', '.join(map(str, ids))} ({address})"
    else:
        who = f"the process at {address}"
    return f"{who} stopped responding: {reason}"


def _interface_address(interface: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("256s", interface.encode()[:15])
        try:
            reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
        except OSError as e:
            raise ValueError(f"interface {interface!r} has no IPv4 address: {e}") from None
    return socket.inet_ntoa(reply[20:24])


def _host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "?"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
