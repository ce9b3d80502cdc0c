"""Training throughput in examples per second (TorchRec's `ThroughputMetric`).

Host-side timing, not a jit metric: call `update()` once per train step on the host.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

MAX_WINDOW_SECONDS = 2 * 60 * 60  # TorchRec's cap on the window


class ThroughputMetric:
    """Examples per second over all processes, over the lifetime and over a time window.

    As TorchRec's: each `update()` marks the end of one step of
    `batch_size * world_size` examples; the first `warmup_steps` steps are not
    timed (compilation, warm caches). Lifetime throughput is the examples after
    warmup over the time since the end of warmup; window throughput is the steps
    of the last `window_seconds` (whole steps, oldest dropped first) times the
    step's examples over their time.

    Args:
      batch_size: examples per step per process.
      world_size: processes (or data-parallel replicas) feeding equal batches.
      window_seconds: window length, >= 1 (capped at 2 hours, as TorchRec).
      warmup_steps: untimed first steps, >= 1.
      clock: seconds, monotonic (`time.monotonic`; tests pass a fake clock).

    `compute()` keys (TorchRec's): "throughput-throughput|total_examples", and after
    warmup "throughput-throughput|lifetime_throughput" and
    "throughput-throughput|window_throughput".

    Example:
      >>> qps = ThroughputMetric(batch_size=4096, world_size=8, window_seconds=100)
      >>> for batch in batches:
      ...     state, loss = step(state, batch)
      ...     qps.update()
      >>> qps.compute()
    """

    namespace = "throughput"

    def __init__(
        self,
        *,
        batch_size: int,
        world_size: int,
        window_seconds: int,
        warmup_steps: int = 100,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for arg, value in (("batch_size", batch_size), ("world_size", world_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ThroughputMetric: {arg} must be a positive int, got {value!r}")
        if window_seconds < 1:
            raise ValueError(
                f"ThroughputMetric: window_seconds must be >= 1, got {window_seconds!r}"
            )
        if warmup_steps < 1:
            raise ValueError(
                f"ThroughputMetric: warmup_steps must be >= 1 (the first step starts the "
                f"clock), got {warmup_steps!r}"
            )
        self.batch_size = batch_size
        self.world_size = world_size
        self.window_seconds = min(window_seconds, MAX_WINDOW_SECONDS)
        self.warmup_steps = warmup_steps
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.total_examples = 0
        self.warmup_examples = 0
        self.time_after_warmup = 0.0
        self._window = collections.deque()  # step durations in the window
        self._window_time = 0.0
        self._previous = 0.0

    @property
    def batch_examples(self) -> int:
        return self.batch_size * self.world_size

    def update(self) -> None:
        """Marks the end of one step."""
        now = self.clock()
        self.steps += 1
        self.total_examples += self.batch_examples
        if self.steps <= self.warmup_steps:
            self.warmup_examples += self.batch_examples
            if self.steps == self.warmup_steps:
                self._previous = now
            return
        lapse = now - self._previous
        self._previous = now
        self.time_after_warmup += lapse
        self._window.append(lapse)
        self._window_time += lapse
        while self._window_time > self.window_seconds:
            self._window_time -= self._window.popleft()

    def compute(self) -> dict[str, float]:
        key = "throughput-throughput|"
        out: dict[str, float] = {f"{key}total_examples": float(self.total_examples)}
        if self.steps <= self.warmup_steps or self.time_after_warmup <= 0:
            return out
        out[f"{key}lifetime_throughput"] = (
            self.total_examples - self.warmup_examples
        ) / self.time_after_warmup
        out[f"{key}window_throughput"] = (
            len(self._window) * self.batch_examples / self._window_time
            if self._window_time > 0
            else 0.0
        )
        return out
