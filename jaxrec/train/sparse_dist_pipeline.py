"""TrainPipelineSparseDist: TrainPipeline with each batch's ids distributed a step ahead.

Each ``progress`` runs step ``i`` on ids already at their shards and sends
batch ``i + 1``'s ids in the same program (``sparse_dist_step.py``): the
first call primes the first batch's distribution, the last one (the loader
is exhausted) drains, running the last batch with nothing new to send.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax

from .pipeline import TrainPipeline
from .sparse_dist_step import SparseDistTrainStep
from .step import TrainState

_END = object()


class TrainPipelineSparseDist(TrainPipeline):
    """TorchRec's ``TrainPipelineSparseDist``: :class:`TrainPipeline` (same arguments and
    ``progress``) whose steps overlap the next batch's input distribution.

    Args:
        train_step: from :func:`~jaxrec.train.make_sparse_dist_train_step`.
        state, to_device, mesh, depth: as :class:`TrainPipeline`'s.

    A step's batch stays alive one step longer (it is distributed by the step
    before the one that trains on it), and a loader error is raised one call
    late, after the batch before it has been trained on.
    """

    def __init__(
        self,
        train_step: SparseDistTrainStep,
        state: TrainState,
        *,
        to_device: Callable[[Any], Any] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        depth: int = 2,
    ):
        if not isinstance(train_step, SparseDistTrainStep):
            raise TypeError(
                "TrainPipelineSparseDist needs a step from make_sparse_dist_train_step, got "
                f"{type(train_step).__name__}; use TrainPipeline for other steps"
            )
        super().__init__(train_step, state, to_device=to_device, mesh=mesh, depth=depth)
        self._ahead: tuple[Any, Any] | None = None  # (ids, batch) of the next step
        self._end: BaseException | None = None  # StopIteration or the loader's error, deferred

    def progress(self, dataloader_iter: Iterator) -> tuple[jax.Array, Any]:
        """Runs one step on the next batch; returns ``(loss, aux)`` (not yet synchronised).

        Raises as :meth:`TrainPipeline.progress` does.
        """
        self._attach(dataloader_iter)
        if self._ahead is None:
            first = self._pull() if self._end is None else _END
            if first is _END:
                self._finish()
            self._ahead = (self._step.input_dist(self.state, first), first)
        ids, batch = self._ahead
        after = self._pull()
        self._ahead = None
        # the last batch: distribute it again (unused), so that one program serves all steps
        nxt = batch if after is _END else after
        self.state, loss, aux, report, next_ids = self._step.jitted(self.state, ids, batch, nxt)
        if after is not _END:
            self._ahead = (next_ids, after)
        self._step.record(report)
        self._check_report()
        self._report = report
        self._window.push(loss)
        return loss, aux

    def _pull(self) -> Any:
        """The next device batch, or ``_END`` (then ``self._end`` says why)."""
        try:
            return next(self._batches)
        except BaseException as e:  # the end, the loader's error or to_device's
            self._end = e
            return _END

    def _finish(self):
        end, self._end = self._end, None
        self._source = None
        if isinstance(end, StopIteration):
            self._flush_warnings()
            self._check_report()
        raise end
