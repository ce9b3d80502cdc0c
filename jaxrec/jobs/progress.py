"""What the job says while it runs: status notes, a progress bar with ETA, the plan.

On a terminal the steps show as a tqdm bar (rate, ETA, loss); elsewhere (a
log file, CI, a test capturing output) as plain lines every ``every`` steps:
``step 50/300  loss 0.4512 nats  48,213 samples/s  eta 0:00:07``. Everything goes
to stderr; stdout keeps the job's one summary line.

samples/s counts training only, as the job's summary does: from the end of the
first step (which compiles) on, with the time spent in :meth:`Progress.paused`
(evaluations) left out. The ETA is wall-clock (pauses included), so it counts
the evaluations still to come at the rate they have come.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TextIO

from tqdm import tqdm


class Progress:
    """Status notes and step progress; silent with ``quiet=True``.

    Args:
        quiet: print nothing.
        every: steps between plain lines (not on a terminal).
        stream: default ``sys.stderr``.
        units: a unit shown after a value, by name (``{"loss": "nats"}``).
    """

    def __init__(
        self,
        *,
        quiet: bool = False,
        every: int = 50,
        stream: TextIO | None = None,
        units: Mapping[str, str] | None = None,
    ):
        self.quiet, self.every = quiet, every
        self.stream = stream or sys.stderr
        self.units = dict(units or {})
        self._paused = 0.0  # seconds in paused() since the first step
        self.tty = self.stream.isatty()
        self.total: int | None = None
        self._bar: tqdm | None = None
        self._first: tuple[int, int, float] | None = None  # step, samples, time after step 1

    def note(self, message: str) -> None:
        """One line, printed above the bar when there is one."""
        if not self.quiet:
            self._write(message)

    def warn(self, message: str) -> None:
        """Like :meth:`note`, but shown with ``quiet`` too: something asked for is skipped."""
        self._write(message)

    def _write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def start(self, total: int, initial: int = 0) -> None:
        """Steps ``initial .. total`` follow (``initial``: resumed from a checkpoint)."""
        self.total = total
        if self.tty and not self.quiet:
            self._bar = tqdm(
                total=total, initial=initial, unit="step", file=self.stream, dynamic_ncols=True
            )

    def update(self, step: int, samples: int, **values: float | int) -> None:
        """After step ``step`` (``samples`` trained so far in this process)."""
        if self.quiet:
            return
        now = time.perf_counter()
        shown = {
            k: (str(v) if isinstance(v, int) else f"{v:.4f}")
            + (f" {self.units[k]}" if k in self.units else "")
            for k, v in values.items()
        }
        first = self._first is None
        if self._first is None:  # the first step compiles: rates start after it
            self._first, self._paused = (step, samples, now), 0.0
        s0, n0, t0 = self._first
        elapsed = max(now - t0, 1e-9)
        training = max(elapsed - self._paused, 1e-9)
        rate = f"{(samples - n0) / training:,.0f} samples/s" if step > s0 else None
        if self._bar is not None:  # tqdm shows steps/s and the ETA itself
            self._bar.set_postfix({**shown, **({"rate": rate} if rate else {})}, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        if step % self.every and step != self.total and not first:  # first: compiled
            return
        parts = [f"step {step}/{self.total}", *(f"{k} {v}" for k, v in shown.items())]
        if rate:
            if self.total is None:
                raise RuntimeError("Progress.update: call start(total) first")
            eta = (self.total - step) * elapsed / (step - s0)
            parts += [rate, f"eta {timedelta(seconds=round(eta))}"]
        print("  ".join(parts), file=self.stream, flush=True)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (an evaluation) is not training: samples/s leaves it out."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - start

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def plan_table(rows: Iterable[tuple[str, str, Sequence[int]]]) -> str:
    """``(table, sharding type, ranks)`` rows as an aligned table; ranks as ``0-7``."""
    text = [(t, kind, _ranks(r)) for t, kind, r in rows]
    head = ("table", "sharding", "ranks")
    widths = [max(len(x) for x in col) for col in zip(head, *text, strict=True)]
    return "\n".join(
        "  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
        for row in [head, *text]
    )


def _ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``0-3``; anything else comma-separated."""
    r = list(ranks)
    if len(r) > 2 and r == list(range(r[0], r[0] + len(r))):
        return f"{r[0]}-{r[-1]}"
    return ",".join(map(str, r))
