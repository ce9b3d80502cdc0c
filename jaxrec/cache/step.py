"""A train step over cached tables: load the batch's rows, then the unchanged step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax

from ..train.step import TrainState, TrainStep
from .errors import hand_back
from .row_cache import Prepared, RowCache


class CachedTrainStep(TrainStep):
    """``step(state, batch)``: :meth:`RowCache.prepare` (unless the batch is already a
    ``Prepared``, e.g. from :func:`prefetching`), :meth:`RowCache.load`, then the
    train step on slots. A ``TrainPipeline`` runs it as any ``TrainStep``."""

    def __init__(self, step: TrainStep, cache: RowCache):
        # Not a jitted function: this class's lower() replaces the one that needs one.
        super().__init__(cast(jax.stages.Wrapped, self._run))
        self.inner, self.cache = step, cache
        self.skipped_steps = step.skipped_steps
        self.step_warnings = step.step_warnings

    def _run(self, state: TrainState, batch: Any):
        prepared = batch if isinstance(batch, Prepared) else self.cache.prepare(batch)
        state = self.cache.load(state, prepared)  # the state given is donated to the load
        try:
            return self.inner.jitted(state, prepared.batch)
        except Exception as e:
            raise handed_back(e, state) from None

    def lower(self, state: TrainState, batch: Any) -> Any:
        return self.inner.lower(state, batch)


def handed_back(err: Exception, state: TrainState) -> Exception:
    """``err`` with ``err.state``: the state after a cache load, for a step that failed
    after it (say, a batch the step cannot trace). The load took the caller's table
    buffers, so this is the state to go on with (``TrainPipeline`` adopts it). Not set
    when the failure also took the loaded state's buffers (a failed run)."""
    if any(x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array)):
        err.add_note(_LOST)
        return err
    hand_back(err, state, _HANDED_BACK)
    return err


_LOST = (
    "jaxrec.cache: the batch's rows were loaded before this failure, which also "
    "consumed the state's buffers: restore the cache from a checkpoint"
)
_HANDED_BACK = (
    "jaxrec.cache: the batch's rows were loaded before the step failed, and the "
    "state passed in was donated to that load: go on with err.state"
)


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
