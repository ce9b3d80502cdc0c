"""Huge pages for a process's large buffers from their first touch.

The CPU kernels read table rows at random, so a table on 4 KiB pages misses the
TLB at almost every row. They advise each large table onto transparent huge
pages at its first use (``csrc/jaxrec_cpu/common.h``), but a table that XLA
has already written sits on 4 KiB pages, and collapsing it copies every page:
about 0.4 GB/s on our VMs, so a first step on 2 GB of tables stalled ~5 s and
on 100 GB it would stall minutes.

glibc's ``glibc.malloc.hugetlb=1`` tunable makes ``malloc`` advise its large
allocations (XLA's CPU buffers, numpy's host tables) before they are touched:
they get huge pages at once and the kernels' advice finds nothing to copy. A
tunable is read when the process starts, so :func:`restart_with_huge_pages`
starts the process again (``os.execve``, same pid and arguments) with it set.
``jaxrec-train-dlrm`` does this; call it first thing in your own CPU training
script. ``JAXREC_CPU_HUGEPAGES=0`` turns both the restart and the advice off.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_page_env(environ: Mapping[str, str], thp_enabled: str | None = None) -> dict | None:
    """The environment to restart with (``environ`` plus the tunable), or None when a
    restart would change nothing: turned off, already set, not glibc, or transparent
    huge pages ``[never]`` (``thp_enabled``: that file's text; read when None)."""
    if environ.get("JAXREC_CPU_HUGEPAGES", "") == "0":
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in tunables or platform.libc_ver()[0] != "glibc":
        return None
    if thp_enabled is None:
        try:
            with open(THP_ENABLED) as f:
                thp_enabled = f.read()
        except OSError:
            return None
    if "[never]" in thp_enabled:
        return None
    value = f"{TUNABLE}=1"
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{value}" if tunables else value}


def started_with_huge_pages(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``GLIBC_TUNABLES`` gives ``malloc`` huge pages (``hugetlb`` 1 or 2)."""
    tunables = environ.get("GLIBC_TUNABLES", "").split(":")
    return any(t.strip() in (f"{TUNABLE}=1", f"{TUNABLE}=2") for t in tunables)


def runs_own_command_line(argv: list[str], orig_argv: list[str]) -> bool:
    """Whether the process was started to run this program: its arguments
    (``sys.argv[1:]``) end the interpreter's command line (``sys.orig_argv``) and its
    name is there (a script's path, ``-c``, or a ``-m`` module). Not so for a program
    run inside another (``runpy`` with its own ``sys.argv``), which a restart would
    start over."""
    tail = argv[1:]
    ends = len(orig_argv) > len(tail) and orig_argv[len(orig_argv) - len(tail) :] == tail
    named = bool(argv) and (argv[0] in orig_argv or "-m" in orig_argv)
    return ends and named


def restart_with_huge_pages() -> None:
    """Starts this process again with ``glibc.malloc.hugetlb=1`` unless it needs no
    restart (:func:`huge_page_env`) or runs inside another program
    (:func:`runs_own_command_line`); returns in the restarted process. Call it before
    any work: nothing of this process survives but its pid, arguments and files."""
    env = huge_page_env(os.environ)
    if env is None or not runs_own_command_line(sys.argv, sys.orig_argv):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
