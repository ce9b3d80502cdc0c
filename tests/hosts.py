"""Test "hosts": Linux network namespaces, each with its own network stack.

:func:`network_hosts` makes ``n`` namespaces joined by a bridge in the root
namespace (one veth pair per host; the host's end is ``eth0``, with its own
``10.a.b.(i+1)/24`` address; loopback up), and removes all of it on exit, also
when the test fails. A process started with :meth:`Host.command` (``ip netns exec``)
sees only its host's interfaces: it reaches the others through the bridge, as
separate machines would reach each other, and binds where a real host's process
binds (gloo: ``GLOO_SOCKET_IFNAME=eth0``). Names carry a random tag, so that
parallel pytest workers do not collide. Without ``ip`` or the right to make
namespaces (CAP_NET_ADMIN), the test is skipped with the reason. A test run
killed outright (SIGKILL) leaves its namespaces and bridge behind: they are named
``jr<tag>h<i>`` and ``jrb<tag>`` (``ip netns del``, ``ip link del``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@dataclasses.dataclass(frozen=True, kw_only=True)
class Host:
    namespace: str  # the network namespace's name
    address: str  # eth0's IPv4 address in it
    interface: str = "eth0"

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@contextlib.contextmanager
def network_hosts(n: int) -> Iterator[list[Host]]:
    """``n`` hosts on one bridge (removed on exit); skips the test where namespaces
    cannot be made."""
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: no `ip` command (iproute2)")
    tag = uuid.uuid4().hex[:6]
    subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
    bridge, namespaces, links = f"jrb{tag}", [], []
    try:
        try:
            _ip("link", "add", bridge, "type", "bridge")
            links.append(bridge)
            _ip("link", "set", bridge, "up")
            hosts = []
            for i in range(n):
                ns, outer = f"jr{tag}h{i}", f"jr{tag}v{i}"
                _ip("netns", "add", ns)
                namespaces.append(ns)
                _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
                links.append(outer)
                _ip("link", "set", outer, "master", bridge)
                _ip("link", "set", outer, "up")
                host = Host(namespace=ns, address=f"{subnet}.{i + 1}")
                _ip("-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                hosts.append(host)
        except OSError as e:
            pytest.skip(f"network namespaces cannot be made here: {e}")
        yield hosts
    finally:
        for link in reversed(links):  # (a veth's peer goes with it)
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Processes:
    """Processes started together, their output in files (readable while they run)."""

    def __init__(self, commands: list[list[str]], envs: list[dict], folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.logs = [folder / f"process{i}.log" for i in range(len(commands))]
        self.procs = []
        for cmd, env, log in zip(commands, envs, self.logs, strict=True):
            with open(log, "w") as out:
                self.procs.append(
                    # (cwd: not a checkout, whose package `python -c` would import first)
                    subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=folder)
                )
        self.ended: list[float | None] = [None] * len(commands)

    def output(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def wait_for(self, done, timeout_s: float, what: str) -> None:
        """Polls ``done()`` until it holds; fails the test (killing all) after ``timeout_s``
        or when a process ended first."""
        deadline = time.monotonic() + timeout_s
        while not done():
            ended = [i for i, p in enumerate(self.procs) if p.poll() is not None]
            if ended or time.monotonic() > deadline:
                self.kill()
                why = f"process {ended[0]} ended" if ended else f"past {timeout_s} s"
                pytest.fail(f"waiting for {what}: {why}\n{self.tails()}")
            time.sleep(0.1)

    def wait(self, timeout_s: float) -> list[int]:
        """Every return code; fails the test (killing all) past ``timeout_s``. Notes
        when each process ended (``ended``, ``time.monotonic()``)."""
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.procs):
            for i, p in enumerate(self.procs):
                if p.poll() is not None and self.ended[i] is None:
                    self.ended[i] = time.monotonic()
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"past {timeout_s} s\n{self.tails()}")
            time.sleep(0.1)
        now = time.monotonic()
        self.ended = [now if t is None else t for t in self.ended]
        return [p.returncode for p in self.procs]

    def tails(self, chars: int = 3000) -> str:
        return "\n----\n".join(
            f"process {i}:\n{self.output(i)[-chars:]}" for i in range(len(self.logs))
        )

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def base_env(paths: list[str], devices: int) -> dict:
    """The parent's environment for a job on ``devices`` CPU devices per process,
    with ``paths`` first on ``PYTHONPATH``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, env.get("PYTHONPATH")]))
    return env
