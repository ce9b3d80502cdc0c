"""Large buffers on huge pages from their first touch (``jaxrec.cpu.hugepages``).

The restart is checked where it matters: in a fresh process, a 64 MiB numpy array
lies on transparent huge pages after ``restart_with_huge_pages``, and (where THP
is ``madvise``-only) not without it.
"""

import json
import os
import platform
import subprocess
import sys

import pytest

from jaxrec.cpu import hugepages

SCRIPT = r"""
import json, os, sys
import numpy as np
from jaxrec.cpu.hugepages import restart_with_huge_pages
pid = os.environ.setdefault("TEST_FIRST_PID", str(os.getpid()))  # survives the exec
restart_with_huge_pages()
a = np.empty(64 << 18, np.float32)  # 64 MiB: malloc maps it on its own
a.fill(1.0)
addr, huge_kb, inside = a.ctypes.data, 0, False
with open("/proc/self/smaps") as f:
    for line in f:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            huge_kb = int(line.split()[1])
print(json.dumps({"same_pid": pid == str(os.getpid()), "huge_kb": huge_kb,
                  "tunables": os.environ.get("GLIBC_TUNABLES", "")}))
"""


def _thp_mode() -> str:
    try:
        with open(hugepages.THP_ENABLED) as f:
            return f.read()
    except OSError:
        return ""


def _glibc() -> tuple[int, ...]:
    name, version = platform.libc_ver()
    parts = version.split(".")[:2]
    return tuple(map(int, parts)) if name == "glibc" and all(p.isdigit() for p in parts) else ()


def _run(**env) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "TEST_FIRST_PID")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_env_adds_the_tunable_once_and_only_when_it_can_help():
    thp = "always [madvise] never"
    assert hugepages.huge_page_env({}, thp)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    kept = hugepages.huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "b"}, thp)
    assert kept == {"A": "b", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert hugepages.huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, thp) is None
    assert hugepages.huge_page_env({"JAXREC_CPU_HUGEPAGES": "0"}, thp) is None
    assert hugepages.huge_page_env({}, "always madvise [never]") is None


def test_env_is_none_without_glibc(monkeypatch):
    monkeypatch.setattr(hugepages.platform, "libc_ver", lambda: ("", ""))
    assert hugepages.huge_page_env({}, "[always] madvise never") is None


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tunable is glibc's")
@pytest.mark.skipif(
    "[never]" in _thp_mode() or not _thp_mode(), reason="transparent huge pages are off here"
)
@pytest.mark.skipif(_glibc() < (2, 35), reason="glibc.malloc.hugetlb needs glibc 2.35")
def test_restart_puts_a_large_array_on_huge_pages():
    on = _run()
    assert on["same_pid"] and on["tunables"] == "glibc.malloc.hugetlb=1"
    assert on["huge_kb"] >= 32 << 10, on  # of 64 MiB (the ends may not fill a huge page)
    off = _run(JAXREC_CPU_HUGEPAGES="0")
    assert off["same_pid"] and off["tunables"] == ""
    if "[madvise]" in _thp_mode():  # else every large mapping is huge anyway
        assert off["huge_kb"] == 0, off


def test_only_a_process_started_for_the_program_restarts():
    own = hugepages.runs_own_command_line
    assert own(
        ["/bin/jaxrec-train-dlrm", "--x", "1"], ["python", "/bin/jaxrec-train-dlrm", "--x", "1"]
    )
    assert own(
        ["/src/jaxrec/jobs/train_dlrm.py", "--x"], ["python", "-m", "jaxrec.jobs.train_dlrm", "--x"]
    )
    assert own(["-c", "a"], ["python", "-c", "code", "a"])
    # runpy inside a driver, with its own sys.argv: a restart would run the driver again
    assert not own(
        ["ex/train_dlrm.py", "--help"], ["python", "-c", "D", "ex/a.py", "ex/train_dlrm.py"]
    )
    assert not own(["ex/train_dlrm.py", "--x"], ["python", "driver.py", "--y"])


def test_started_with_huge_pages_reads_the_tunable():
    on = hugepages.started_with_huge_pages
    assert on({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"})
    assert not on({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) and not on({})
