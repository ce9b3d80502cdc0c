"""Compile cases deviceless for an H100 in worker subprocesses, each case isolated and timed out.

XLA's GPU compiler can abort the whole process (an op the target does not
support) or keep ``ptxas`` busy for minutes (a pathological tiling), so cases
never compile in the pytest process. A worker (``python compile_runner.py
--worker``, ``JAX_PLATFORMS=cpu``, ``TF_CPP_MIN_LOG_LEVEL=0`` so that
``ptxas``'s spill warnings are logged) imports JAX once, then compiles the
cases it is sent one after another, printing a start marker, the compiler's
log lines and an end marker carrying the result as one JSON line. The parent
gives each case a deadline: a case that outlives it, or whose worker dies,
is recorded as failed with the tail of the worker's output, the worker's
process group is killed, and a fresh worker takes the remaining cases. So a
run costs one Python + JAX start per worker, not per case.

Adding cases (e.g. ``train_cases.py`` beside this file):

1. Write a function that builds abstract inputs and returns the compiled
   program, usually ``compile_abstract(fn, *args)`` (sharded programs: build
   ``jaxrec.deviceless`` shardings yourself and compile with
   ``compiler_options=COMPILER_OPTIONS``, which see); it may return
   ``(compiled, facts)`` where ``facts`` is a JSON-able dict (e.g. bytes of
   collectives read from ``compiled.as_text()``), reported in
   ``CaseResult.facts`` (compiled programs cannot leave the worker). Raise to
   fail the case. Keep arguments JSON-able: the worker receives them as JSON.
2. List ``Case(name="...", target="train_cases:my_function", kwargs={...})`` in a
   module-level tuple. ``timeout_s`` bounds one case (the default suits
   kernels; a sharded train step may need more), ``max_spill_bytes`` its
   ``ptxas`` spills (see ``SPILL_LIMIT``).
3. In a test module: a module-scoped fixture that calls
   ``require_deviceless()`` then ``run_cases(CASES)``, and a test
   parametrized over ``CASES`` (``ids=case_id``) calling
   ``assert_compiled(results[case.name], case)``; see
   ``test_gpu_compile_kernels.py``.

Cases run on ``workers`` subprocesses in parallel (default
``GPU_COMPILE_WORKERS`` or 2); ``python compile_runner.py kernel_cases``
runs a case module from the command line and prints one JSON line per case
(``step_cases`` imports ``bench/``: ``PYTHONPATH=../../bench`` there, as
pytest's ``pythonpath`` and ``worker_env`` give it).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "..", "bench")  # step_cases builds on bench/deviceless_step.py
START, END, READY = "@@gpu_compile start ", "@@gpu_compile end ", "@@gpu_compile ready"
# A kernel compiles in ~0.3-3 s on 2 busy cores; the deadline only stops a hung ptxas.
CASE_TIMEOUT_S = 120.0
WORKER_START_TIMEOUT_S = 180.0  # importing JAX and the CUDA plugin on a loaded CI machine
# ptxas spills: bytes stored to local memory per case, summed over the
# program's kernels. Measured over kernel_cases.py (ptxas 13.0, sm_90a): no
# kernel spills at its default tiling; the most any case spills without an
# allowance is 36 bytes (pooled fp32 lookup, D=512, Tiling(16, 2): nine
# registers round-tripped through L1 per step, noise beside the 2 KiB row the
# step gathers). 64 leaves room for ptxas version noise, while a kernel whose
# accumulators or optimizer state stop fitting in registers (hundreds of bytes
# and up) fails. Known larger spills get a per-case allowance, justified there.
SPILL_LIMIT = 64
# The limits above are for jaxrec's own kernels (Pallas kernels are named
# "jaxrec_*"). A train step's program also holds XLA's fusions, whose register
# allocation is XLA's: spills there are reported and bounded only against a
# blow-up. Measured (ptxas 13.0, default train-step cases): 44-60 bytes in
# most, 1,564 in one reduce fusion of the 8 x 80 GB Criteo plan (bounds-report
# and row-sum reductions over many tables); 4 KiB leaves 2.5x room.
XLA_SPILL_LIMIT = 4096
TAIL_LINES = 40
_SPILL = re.compile(r"in function '([^']+)', (\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One program to compile: ``target`` is ``"module:function"`` (modules beside this file)."""

    name: str
    target: str
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    timeout_s: float = CASE_TIMEOUT_S
    max_spill_bytes: int = SPILL_LIMIT

    def __post_init__(self):
        if ":" not in self.target:
            raise ValueError(f"Case target must be 'module:function', got {self.target!r}")
        json.dumps(self.kwargs)  # raises TypeError now, not inside a worker


@dataclasses.dataclass(frozen=True, kw_only=True)
class CaseResult:
    """What happened to one case. ``error`` is None when it compiled."""

    name: str
    error: str | None
    seconds: float | None = None  # build + trace + lower + compile, in the worker
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    spills: tuple[tuple[str, int, int], ...] = ()  # (kernel, stores, loads) per ptxas warning
    memory: dict[str, int] = dataclasses.field(default_factory=dict)  # memory_analysis()
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    worker_pid: int | None = None
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


def case_id(case: Case) -> str:
    return case.name


def parse_spills(lines: Iterable[str]) -> tuple[tuple[str, int, int], ...]:
    """``(kernel, store bytes, load bytes)`` of every ptxas spill warning in ``lines``."""
    found = (_SPILL.search(line) for line in lines)
    return tuple((m[1], int(m[2]), int(m[3])) for m in found if m)


# ----------------------------------------------------------------------------- worker side


# No CUB radix sort without a device (see jaxrec.deviceless.COMPILER_OPTIONS).
COMPILER_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}


def lower_abstract(fn, *args, topology: str = "1x1x1"):
    """``jax.jit(fn)`` lowered for ``topology`` (H100s) with ``args`` as abstract values.

    ``args`` are pytrees of ``jax.ShapeDtypeStruct`` (or arrays, only their
    shape and dtype are used), placed replicated on a mesh over every device;
    nothing is allocated. ``None`` passes through.
    """
    import jax

    from jaxrec import deviceless

    mesh = deviceless.mesh(deviceless.topology(topology))
    abstract = [None if a is None else deviceless.abstract_like(a, mesh) for a in args]
    return jax.jit(fn).trace(*abstract).lower()


def compile_abstract(fn, *args, topology: str = "1x1x1"):
    """:func:`lower_abstract`'s program compiled with ``COMPILER_OPTIONS``."""
    return lower_abstract(fn, *args, topology=topology).compile(compiler_options=COMPILER_OPTIONS)


def _memory(compiled) -> dict[str, int]:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # not every backend reports it; the compile itself succeeded
        return {}
    names = ("argument", "output", "alias", "temp", "generated_code")
    return {n: int(getattr(stats, f"{n}_size_in_bytes", 0)) for n in names}


def _run_one(spec: dict) -> dict:
    module, _, function = spec["target"].partition(":")
    t0 = time.perf_counter()
    try:
        out = getattr(importlib.import_module(module), function)(**spec["kwargs"])
        compiled, facts = out if isinstance(out, tuple) else (out, {})
        return {
            "error": None,
            "seconds": time.perf_counter() - t0,
            "memory": _memory(compiled),
            "facts": facts,
        }
    except Exception as e:
        text = "".join(traceback.format_exception_only(e)).strip()
        return {"error": text, "seconds": time.perf_counter() - t0}


def worker_main() -> None:
    """Read case specs (JSON lines) from stdin; compile each; report on stdout."""
    os.dup2(1, 2)  # one ordered stream: the compiler's log lines fall between the markers
    sys.stderr = sys.stdout
    import jax  # noqa: F401  (the start-up cost, paid before the first deadline starts)

    from jaxrec import deviceless

    deviceless.topology("1x1x1")
    print(READY, flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        print(START + spec["name"], flush=True)
        result = _run_one(spec)
        sys.stdout.flush()
        print(END + json.dumps({"name": spec["name"], **result}), flush=True)


# ----------------------------------------------------------------------------- parent side


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",  # the CUDA plugin registers its topologies without a GPU
        TF_CPP_MIN_LOG_LEVEL="0",  # ptxas spill warnings are INFO log lines
        JAX_ENABLE_COMPILATION_CACHE="false",  # a cache hit would skip ptxas and its log
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [BENCH, env.get("PYTHONPATH")])),
    )
    return env


class _Worker:
    """One worker process; ``run`` sends a case and waits for its end marker or the deadline."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=worker_env(),
            cwd=HERE,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: a kill also ends ptxas
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.startup: list[str] = []

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # EOF: the worker died or exited

    def _next(self, deadline: float) -> str | None:
        """The next line; None at EOF; raises TimeoutError past ``deadline``."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        try:
            return self.lines.get(timeout=left)
        except queue.Empty:
            raise TimeoutError from None

    def wait_ready(self) -> str | None:
        """None when ready, else why not (with the output so far)."""
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        try:
            while (line := self._next(deadline)) is not None:
                if line == READY:
                    return None
                self.startup.append(line)
            why = f"worker exited with {self.proc.wait()} before it was ready"
        except TimeoutError:
            why = f"worker not ready within {WORKER_START_TIMEOUT_S:.0f} s"
        return why + "\n" + "\n".join(self.startup[-TAIL_LINES:])

    def run(self, case: Case) -> tuple[CaseResult, bool]:
        """The case's result and whether the worker is still usable."""
        spec = {"name": case.name, "target": case.target, "kwargs": case.kwargs}
        try:
            self.proc.stdin.write(json.dumps(spec) + "\n")
            self.proc.stdin.flush()
        except OSError:  # died after its last case; its EOF is read below
            pass
        deadline = time.monotonic() + case.timeout_s
        log: list[str] = []
        started = False
        try:
            while (line := self._next(deadline)) is not None:
                if line.startswith(START):
                    started = True
                elif line.startswith(END):
                    return self._result(json.loads(line[len(END) :]), log), True
                elif started:
                    log.append(line)
            code = self.proc.wait()
            why = f"worker died (exit status {code}{_signal_name(code)}) while compiling"
        except TimeoutError:
            why = f"timed out after {case.timeout_s:g} s (worker killed)"
        tail = "\n".join(log[-TAIL_LINES:])
        return CaseResult(
            name=case.name,
            error=f"{why}; last output:\n{tail}",
            spills=parse_spills(log),
            worker_pid=self.proc.pid,
            log_tail=tail,
        ), False

    def _result(self, reported: dict, log: list[str]) -> CaseResult:
        spills = parse_spills(log)
        return CaseResult(
            name=reported["name"],
            error=reported["error"],
            seconds=reported["seconds"],
            spill_store_bytes=sum(s[1] for s in spills),
            spill_load_bytes=sum(s[2] for s in spills),
            spills=spills,
            memory=reported.get("memory", {}),
            facts=reported.get("facts", {}),
            worker_pid=self.proc.pid,
            log_tail="\n".join(log[-TAIL_LINES:]),
        )

    def close(self, kill: bool = False):
        if self.proc.poll() is None:
            if kill:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.reader.join(timeout=30)  # it ends at EOF; closing stdout under it would raise
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.stdout.close()


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f", {signal.Signals(-code).name}"
        except ValueError:
            pass
    return ""


def _slot(pending: queue.Queue, results: dict[str, CaseResult]) -> None:
    """Run cases from ``pending`` on one worker at a time, replacing a worker that fails."""
    worker = None
    while True:
        try:
            case = pending.get_nowait()
        except queue.Empty:
            break
        if worker is None:
            worker = _Worker()
            why = worker.wait_ready()
            if why is not None:  # a worker that cannot start fails every case left
                worker.close(kill=True)
                results[case.name] = CaseResult(name=case.name, error=why)
                while not pending.empty():
                    case = pending.get_nowait()
                    results[case.name] = CaseResult(name=case.name, error=why)
                return
        result, usable = worker.run(case)
        results[case.name] = result
        if not usable:
            worker.close(kill=True)
            worker = None
    if worker is not None:
        worker.close()


def run_cases(cases: Sequence[Case], workers: int | None = None) -> dict[str, CaseResult]:
    """Compile every case (in order, across ``workers`` subprocesses); results by name."""
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"case names must be unique, got duplicates in {names}")
    if workers is None:
        workers = int(os.environ.get("GPU_COMPILE_WORKERS", "2"))
    pending: queue.Queue[Case] = queue.Queue()
    for case in cases:
        pending.put(case)
    results: dict[str, CaseResult] = {}
    threads = [
        threading.Thread(target=_slot, args=(pending, results))
        for _ in range(max(1, min(workers, len(cases))))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {name: results[name] for name in names}


def require_deviceless() -> None:
    """Skip when this machine cannot compile for GPUs; fail instead under CI (``CI=true``)."""
    import pytest

    from jaxrec import deviceless

    reason = deviceless.unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must compile for GPUs deviceless, but cannot: {reason}")
    pytest.skip(f"deviceless GPU compilation unavailable: {reason}")


def assert_compiled(result: CaseResult, case: Case) -> None:
    """The case compiled and ``ptxas`` spilled no more than the case allows (jaxrec's
    kernels together: ``case.max_spill_bytes``; each XLA fusion: ``XLA_SPILL_LIMIT``)."""
    if not result.ok:
        raise AssertionError(f"{case.name} did not compile: {result.error}")
    ours = [s for s in result.spills if s[0].startswith("jaxrec_")]
    stored = sum(s[1] for s in ours)
    if stored > case.max_spill_bytes:
        raise AssertionError(
            f"{case.name}: ptxas spilled {stored} bytes to local memory in jaxrec's kernels "
            f"(allowed {case.max_spill_bytes}): {ours}. Use a smaller tile or fewer live "
            "values per thread."
        )
    xla = [s for s in result.spills if not s[0].startswith("jaxrec_") and s[1] > XLA_SPILL_LIMIT]
    if xla:
        raise AssertionError(
            f"{case.name}: ptxas spilled over {XLA_SPILL_LIMIT} bytes in XLA's fusions: {xla}"
        )


def _main(argv: Sequence[str]) -> None:
    if list(argv) == ["--worker"]:
        worker_main()
        return
    for module in argv:  # command line: run the CASES of each module, one JSON line per case
        cases = importlib.import_module(module).CASES
        for r in run_cases(cases).values():
            print(json.dumps(dataclasses.asdict(r) | {"log_tail": r.log_tail[-400:]}))


if __name__ == "__main__":
    _main(sys.argv[1:])
