"""A train step over cached tables: load the batch's rows, then the unchanged step."""

from __future__ import annotations

from typing import Any

from ..train.step import TrainState, TrainStep
from .row_cache import Prepared, RowCache


class CachedTrainStep(TrainStep):
    """``step(state, batch)``: :meth:`RowCache.prepare` (unless the batch is already a
    ``Prepared``, e.g. from :func:`prefetching`), :meth:`RowCache.load`, then the
    train step on slots. A ``TrainPipeline`` runs it as any ``TrainStep``."""

    def __init__(self, step: TrainStep, cache: RowCache):
        super().__init__(self._run)
        self.inner, self.cache = step, cache
        self.skipped_steps = step.skipped_steps
        self.step_warnings = step.step_warnings

    def _run(self, state: TrainState, batch: Any):
        prepared = batch if isinstance(batch, Prepared) else self.cache.prepare(batch)
        state = self.cache.load(state, prepared)
        return self.inner.jitted(state, prepared.batch)

    def lower(self, state: TrainState, batch: Any) -> Any:
        return self.inner.lower(state, batch)
