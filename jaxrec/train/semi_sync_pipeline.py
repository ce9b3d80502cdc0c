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

from .ahead_pipeline import AheadPipeline
from .semi_sync import LookedUp, SemiSyncTrainStep
from .step import TrainState


class TrainPipelineSemiSync(AheadPipeline):
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

    _step: SemiSyncTrainStep  # checked in __init__

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
        self._sync_left = start_batch  # batches still to train synchronously

    def _prime(self, batch: Any) -> LookedUp:
        return self._step.lookup(self.state, batch)

    def progress(self, dataloader_iter: Iterator) -> tuple[jax.Array, Any]:
        """Runs one step on the next batch; returns ``(loss, aux)`` (not yet synchronised).

        Raises as :meth:`TrainPipeline.progress` does.
        """
        self._attach(dataloader_iter)
        if not (self._sync_left and self._ahead is None):
            return super().progress(dataloader_iter)
        # start_batch: a synchronous step; the next semi-sync step primes
        batch = self._next_or_finish()
        self.state, loss, aux, report = self._step.sync(self.state, batch)
        self._sync_left -= 1
        return self._done(report, loss, aux)
