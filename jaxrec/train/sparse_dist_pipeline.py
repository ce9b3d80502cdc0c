"""TrainPipelineSparseDist: TrainPipeline with each batch's ids distributed a step ahead.

Each ``progress`` runs step ``i`` on ids already at their shards and sends
batch ``i + 1``'s ids in the same program (``sparse_dist_step.py``): the
first call primes the first batch's distribution, the last one (the loader
is exhausted) drains, running the last batch with nothing new to send.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .ahead_pipeline import AheadPipeline
from .sparse_dist_step import SparseDistTrainStep
from .step import TrainState


class TrainPipelineSparseDist(AheadPipeline):
    """TorchRec's ``TrainPipelineSparseDist``: :class:`TrainPipeline` (same arguments and
    ``progress``) whose steps overlap the next batch's input distribution.

    Args:
        train_step: from :func:`~jaxrec.train.make_sparse_dist_train_step`.
        state, to_device, mesh, depth: as :class:`TrainPipeline`'s.

    A step's batch stays alive one step longer (it is distributed by the step
    before the one that trains on it), and a loader error is raised one call
    late, after the batch before it has been trained on.
    """

    _step: SparseDistTrainStep  # checked in __init__

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

    def _prime(self, batch: Any) -> dict:
        return self._step.input_dist(self.state, batch)
