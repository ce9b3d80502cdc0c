"""A train step over cached tables: load the batch's rows, then the unchanged step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

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


def prefetching(cache: RowCache, to_device: Callable[[Any], Any] = jax.device_put):
    """A ``to_device`` for ``TrainPipeline`` that also prepares each batch: the
    pipeline's thread plans batch ``i + depth``'s slots and starts its transfer while
    step ``i`` runs (TorchRec's prefetch pipeline); the step then only loads the rows.

    Example:
        >>> step = CachedTrainStep(make_train_step(graphdef, optimizer, loss_fn), cache)
        >>> pipeline = TrainPipeline(step, state, to_device=prefetching(cache))
    """

    def prepare(batch: Any) -> Prepared:
        p = cache.prepare(batch)
        return p._replace(batch=to_device(p.batch))

    return prepare
