"""TrainPipelineSemiSync: TrainPipeline with each batch's embeddings looked up a step ahead.

Each ``progress`` runs step ``i`` on embeddings looked up by the step before and
looks batch ``i + 1``'s up in the same program (``semi_sync.py``): the first call
primes the first batch's lookup, the last one (the loader is exhausted) drains,
running the last batch with nothing new to look up. A new loader primes again,
so the first batch of each loader is looked up with up-to-date tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax

from .pipeline import TrainPipeline
from .semi_sync import SemiSyncTrainStep
from .step import TrainState

_END = object()


class TrainPipelineSemiSync(TrainPipeline):
    """TorchRec's ``TrainPipelineSemiSync``: :class:`TrainPipeline` (same arguments and
    ``progress``) whose steps train the dense part on embeddings looked up one step
    earlier, overlapping the next batch's lookup with the dense forward and backward.

    Embedding updates land one step late: batch ``i + 1`` is looked up before batch
    ``i``'s sparse gradients are applied (dense parameters are never stale).

    Args:
        train_step: from :func:`~jaxrec.train.make_semi_sync_train_step`.
        state, to_device, mesh, depth: as :class:`TrainPipeline`'s.
        start_batch: TorchRec's argument: the first ``start_batch`` batches this
            pipeline trains are trained synchronously (``train_step.sync``, no
            staleness while the tables are young), then it switches to semi-sync,
            priming the lookup of the next batch. TorchRec's default is 900; here 0.

    A batch stays alive one step longer (it is looked up by the step before the one
    that trains on it), and a loader error is raised one call late, after the batch
    before it has been trained on.
    """

    def __init__(
        self,
        train_step: SemiSyncTrainStep,
        state: TrainState,
        *,
        to_device: Callable[[Any], Any] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        depth: int = 2,
        start_batch: int = 0,
    ):
        if not isinstance(start_batch, int) or start_batch < 0:
            raise ValueError(f"start_batch must be a non-negative int, got {start_batch!r}")
        if not isinstance(train_step, SemiSyncTrainStep):
            raise TypeError(
                "TrainPipelineSemiSync needs a step from make_semi_sync_train_step, got "
                f"{type(train_step).__name__}; use TrainPipeline for other steps"
            )
        super().__init__(train_step, state, to_device=to_device, mesh=mesh, depth=depth)
        self._ahead: tuple[Any, Any] | None = None  # (LookedUp, batch) of the next step
        self._end: BaseException | None = None  # StopIteration or the loader's error, deferred
        self._sync_left = start_batch  # batches still to train synchronously

    def progress(self, dataloader_iter: Iterator) -> tuple[jax.Array, Any]:
        """Runs one step on the next batch; returns ``(loss, aux)`` (not yet synchronised).

        Raises as :meth:`TrainPipeline.progress` does.
        """
        self._attach(dataloader_iter)
        if self._sync_left and self._ahead is None:
            return self._sync_step()
        if self._ahead is None:
            first = self._pull() if self._end is None else _END
            if first is _END:
                self._finish()
            self._ahead = (self._step.lookup(self.state, first), first)
        looked_up, batch = self._ahead
        after = self._pull()
        self._ahead = None
        # the last batch: look it up again (unused), so that one program serves all steps
        nxt = batch if after is _END else after
        self.state, loss, aux, report, ahead = self._step.jitted(self.state, looked_up, batch, nxt)
        if after is not _END:
            self._ahead = (ahead, after)
        self._step.record(report)
        self._check_report()
        self._report = report
        self._window.push(loss)
        return loss, aux

    def _sync_step(self) -> tuple[jax.Array, Any]:
        """One synchronous step (``start_batch``); the next semi-sync step primes."""
        batch = self._pull() if self._end is None else _END
        if batch is _END:
            self._finish()
        self.state, loss, aux, report = self._step.sync(self.state, batch)
        self._sync_left -= 1
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
