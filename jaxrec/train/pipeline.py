"""TrainPipeline: TorchRec's ``progress(dataloader_iter)`` loop with host work overlapped.

JAX dispatches a step and returns before the device finishes, so the host is
free while step ``i`` runs. The pipeline fills that time: a background thread
pulls the next batches from the data loader (host preprocessing) and starts
their host-to-device transfers (``jax.device_put``, or ``shard_batch`` over a
mesh), ``depth`` batches ahead. The main thread only dispatches steps, and
reads a step's report (a sharded step's dropped-id count, FATAL bounds
checks, the skipped flag) one step late, so it never waits on the step it
just launched; warnings (``BoundsCheckMode.WARNING``, ``overflow="warn"``)
are logged once ready, at the latest two steps late, and all of them when the
loader is exhausted or the pipeline is closed.

A sharded model's input distribution (the ``all_to_all`` of ids) stays inside
each step's program, before its lookups; :class:`TrainPipelineSparseDist`
(``sparse_dist_pipeline.py``) sends batch ``i + 1``'s ids from step ``i``'s
program instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax

from ..datasets import Prefetcher, prefetch
from ..distributed import shard_batch
from .guard import raise_for_report
from .in_flight import InFlight
from .step import TrainState, TrainStep


class TrainPipeline:
    """Runs ``train_step`` over a data loader with batch preparation and transfers overlapped.

    TorchRec's ``TrainPipelineBase`` / ``TrainPipelineSparseDist`` role. The
    model state lives in the pipeline (``pipeline.state``) and is donated to
    each step.

    Args:
        train_step: a :class:`~jaxrec.train.TrainStep` from
            :func:`jaxrec.train.make_train_step` (its reports are read one step
            late), or any ``step(state, batch) -> (state, loss, aux)`` callable
            (run as it is: no report, no skipped-step count).
        state: the initial :class:`TrainState`.
        to_device: host batch -> device batch (default ``jax.device_put``; with
            ``mesh``, :func:`jaxrec.distributed.shard_batch` of a list of
            per-device local batches, which is then what the loader yields).
        mesh: the device mesh of a sharded model.
        depth: batches prepared and in flight ahead of the running step; also the
            steps whose results may be outstanding (the host waits for the step
            ``depth`` back before launching another: see ``in_flight.py``).

    Example:
        >>> pipeline = TrainPipeline(step, state)
        >>> it = iter(loader)
        >>> while True:
        ...     try:
        ...         loss, _ = pipeline.progress(it)
        ...     except StopIteration:
        ...         break
    """

    def __init__(
        self,
        train_step: TrainStep | Callable[[TrainState, Any], tuple[TrainState, jax.Array, Any]],
        state: TrainState,
        *,
        to_device: Callable[[Any], Any] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        depth: int = 2,
    ):
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth=}")
        if to_device is None:
            if mesh is None:
                to_device = jax.device_put
            else:
                to_device = lambda local_batches: shard_batch(local_batches, mesh)
        self.state = state
        self._step = train_step
        self._to_device = to_device
        self._depth = depth
        self._source: Iterator | None = None
        self._batches: Prefetcher | None = None  # device batches, prepared ahead
        self._report = None  # the previous step's StepReport (read one step late)
        self._window = InFlight(depth)  # never further ahead: see in_flight.py

    def progress(self, dataloader_iter: Iterator) -> tuple[jax.Array, Any]:
        """Runs one step on the next batch; returns ``(loss, aux)`` (not yet synchronised).

        Raises:
            StopIteration: the loader is exhausted (every batch has been trained on).
            CapacityOverflowError: the previous step dropped ids (sharded models,
                ``overflow="raise"``).
            BoundsCheckError: the previous step found out-of-range ids under
                ``BoundsCheckMode.FATAL`` and applied nothing; ``err.state`` (also
                ``pipeline.state``) includes the step after it.

        Any error of the step that carries ``err.state`` (a cached step's, raised after
        its batch's rows were loaded) leaves that state in ``pipeline.state``; the
        pipeline goes on with the next batch at the next call.
        """
        self._attach(dataloader_iter)
        assert self._batches is not None  # set by _attach
        try:
            item = next(self._batches)
        except StopIteration:
            self._source = None
            self._flush_warnings()
            self._check_report()
            raise
        except BaseException:  # the loader's or to_device's error, raised here
            self._source = None
            raise
        if not isinstance(self._step, TrainStep):  # a plain step function
            self.state, loss, aux = self._step(self.state, item)
            self._window.push(loss)
            return loss, aux
        try:
            self.state, loss, aux, report = self._step.jitted(self.state, item)
        except Exception as e:  # a step that took the state and hands back another
            state = getattr(e, "state", None)
            if isinstance(state, TrainState):
                self.state = state
            raise
        self._step.record(report)
        self._check_report()  # the previous step's: long finished, no stall
        self._report = report
        self._window.push(loss)
        return loss, aux

    def skipped_steps(self) -> int:
        """Steps that applied nothing (``make_train_step(skip_nonfinite=True)``) so far."""
        return self._step.skipped_steps() if isinstance(self._step, TrainStep) else 0

    def close(self) -> None:
        """Stops the background thread (it also stops at the loader's end) and logs
        every pending warning."""
        self._flush_warnings()
        if self._batches is not None:
            self._batches.close()

    def _attach(self, it: Iterator) -> None:
        if it is self._source:
            return
        if self._source is not None:
            raise ValueError(
                "progress() got a new data loader iterator before the current one was "
                "exhausted; pass the same iterator until StopIteration"
            )
        self.close()
        self._source = it
        self._batches = prefetch(map(self._to_device, it), size=self._depth)

    def _flush_warnings(self) -> None:
        if isinstance(self._step, TrainStep):
            self._step.flush_warnings()

    def _check_report(self) -> None:
        report, self._report = self._report, None
        if report is not None:
            try:
                raise_for_report(report, self.state)
            except Exception:
                self._flush_warnings()  # the failed step has finished: log what it found
                raise
