"""The loop both look-ahead pipelines share: each step also prepares the next batch.

``TrainPipelineSparseDist`` (the next batch's ids sent to their shards) and
``TrainPipelineSemiSync`` (the next batch's embeddings looked up) run steps
``jitted(state, carried, batch, next_batch) -> (state, loss, aux, report,
next_carried)``: the first ``progress`` primes the first batch's carried value
(:meth:`AheadPipeline._prime`), the last one (the loader is exhausted) drains,
running the last batch with its own batch as the next (the result is unused, so
one program serves every step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax

from .guard import StepReport
from .pipeline import TrainPipeline
from .step import TrainState, TrainStep

_END = object()


class AheadPipeline(TrainPipeline):
    """:class:`TrainPipeline` whose step carries a value prepared a step ahead.

    Subclasses give :meth:`_prime`. A step's batch stays alive one step longer, and a
    loader error is raised one call late, after the batch before it has been trained on.
    """

    def __init__(
        self,
        train_step: TrainStep,
        state: TrainState,
        *,
        to_device: Callable[[Any], Any] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        depth: int = 2,
    ):
        super().__init__(train_step, state, to_device=to_device, mesh=mesh, depth=depth)
        self._ahead: tuple[Any, Any] | None = None  # (carried value, batch) of the next step
        self._end: BaseException | None = None  # StopIteration or the loader's error, deferred

    def _prime(self, batch: Any) -> Any:
        """The carried value of ``batch`` when no step prepared it (the first batch)."""
        raise NotImplementedError

    def progress(self, dataloader_iter: Iterator) -> tuple[jax.Array, Any]:
        """Runs one step on the next batch; returns ``(loss, aux)`` (not yet synchronised).

        Raises as :meth:`TrainPipeline.progress` does.
        """
        self._attach(dataloader_iter)
        if self._ahead is None:
            self._ahead = (self._prime(first := self._next_or_finish()), first)
        carried, batch = self._ahead
        after = self._pull()
        self._ahead = None
        nxt = batch if after is _END else after
        self.state, loss, aux, report, ahead = self._step.jitted(self.state, carried, batch, nxt)
        if after is not _END:
            self._ahead = (ahead, after)
        return self._done(report, loss, aux)

    def _done(self, report: StepReport, loss: jax.Array, aux: Any) -> tuple[jax.Array, Any]:
        """Records a launched step (its report is checked one step late)."""
        self._step.record(report)
        self._check_report()
        self._report = report
        self._window.push(loss)
        return loss, aux

    def _next_or_finish(self) -> Any:
        """The next device batch; at the end (or a loader error) raises it."""
        batch = self._pull() if self._end is None else _END
        if batch is _END:
            self._finish()
        return batch

    def _pull(self) -> Any:
        """The next device batch, or ``_END`` (then ``self._end`` says why)."""
        assert self._batches is not None  # set by _attach
        try:
            return next(self._batches)
        except BaseException as e:  # the end, the loader's error or to_device's
            self._end = e
            return _END

    def _finish(self):
        end, self._end = self._end, None
        assert end is not None  # called once _pull has met the end
        self._source = None
        if isinstance(end, StopIteration):
            self._flush_warnings()
            self._check_report()
        raise end
