"""Where the DLRM job's tables live, and what that changes in a run: all on the
devices (:class:`DeviceTables`), or some in host memory behind a device cache
(:class:`CachedTables`, TorchRec's ``fused_uvm_caching``). The job's steps call
these and never ask which they have."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
from flax import nnx

from ..cache import CachedTrainStep, RowCache, prefetching
from ..checkpoint import CheckpointManager
from ..datasets import TableDataset
from ..distributed.planner import MissRateCurve
from ..embedding import CombinedOptimizer
from ..train import TrainState, TrainStep
from .dlrm_cache import cache_summary
from .dlrm_config import DlrmJobConfig
from .dlrm_parts import EvalStep, evaluate, evaluate_cached

# host batch (or a step's micro-batches) -> device batch
ToDevice = Callable[[Any], Any]


class Tables(Protocol):
    """What a run does with its tables' rows: train, evaluate, checkpoint, report."""

    def wrap(self, step: TrainStep, to_device: ToDevice) -> tuple[TrainStep, ToDevice]:
        """``(step, to_device)`` as the pipeline runs them."""
        ...

    def resume(self, ckpt: CheckpointManager, state: TrainState) -> tuple[TrainState, int]:
        """``(state, step)`` of the newest intact checkpoint."""
        ...

    def save(self, ckpt: CheckpointManager, at: int, state: TrainState) -> None: ...

    def evaluate(
        self,
        eval_step: EvalStep,
        state: TrainState,
        data: TableDataset,
        config: DlrmJobConfig,
        mesh: jax.sharding.Mesh | None,
    ) -> tuple[dict[str, float], TrainState]:
        """``(metrics, state)``: go on with the state returned."""
        ...

    def summary(self) -> dict[str, object]:
        """The summary's entries about the tables (none for device tables)."""
        ...

    def close(self) -> None: ...


class DeviceTables:
    """Every table on the devices: the train state holds all of it."""

    def __init__(self, graphdef: nnx.GraphDef, optimizer: CombinedOptimizer):
        self.graphdef, self.optimizer = graphdef, optimizer

    def wrap(self, step: TrainStep, to_device: ToDevice) -> tuple[TrainStep, ToDevice]:
        return step, to_device

    def resume(self, ckpt: CheckpointManager, state: TrainState) -> tuple[TrainState, int]:
        return ckpt.resume(self.graphdef, self.optimizer, state)

    def save(self, ckpt: CheckpointManager, at: int, state: TrainState) -> None:
        ckpt.save(at, self.graphdef, self.optimizer, state, force=True)

    def evaluate(
        self,
        eval_step: EvalStep,
        state: TrainState,
        data: TableDataset,
        config: DlrmJobConfig,
        mesh: jax.sharding.Mesh | None,
    ) -> tuple[dict[str, float], TrainState]:
        return evaluate(eval_step, state, data, config, mesh), state

    def summary(self) -> dict[str, object]:
        return {}

    def close(self) -> None:
        pass


class CachedTables:
    """Some tables in host memory, their rows cached on the devices (``rc``): each
    batch's rows are planned and gathered a batch ahead, checkpoints hold the host
    tables. ``stats``: the planner's measured miss rates, for the summary."""

    def __init__(
        self, rc: RowCache, stats: Mapping[str, MissRateCurve] | None, config: DlrmJobConfig
    ):
        self.rc, self.stats = rc, stats
        k = config.grad_accumulation
        if k > 1:
            raise SystemExit(f"--grad-accumulation {k} does not take cached tables")
        if config.pipeline != "sync":
            raise SystemExit(f"--pipeline {config.pipeline} does not take cached tables: use sync")

    def wrap(self, step: TrainStep, to_device: ToDevice) -> tuple[TrainStep, ToDevice]:
        return CachedTrainStep(step, self.rc), prefetching(self.rc, to_device)

    def resume(self, ckpt: CheckpointManager, state: TrainState) -> tuple[TrainState, int]:
        return self.rc.resume(ckpt, state)  # the host tables restored, the cache empty

    def save(self, ckpt: CheckpointManager, at: int, state: TrainState) -> None:
        self.rc.save(ckpt, at, state, force=True)  # the cache flushed first

    def evaluate(
        self,
        eval_step: EvalStep,
        state: TrainState,
        data: TableDataset,
        config: DlrmJobConfig,
        mesh: jax.sharding.Mesh | None,
    ) -> tuple[dict[str, float], TrainState]:
        return evaluate_cached(eval_step, state, data, config, mesh, self.rc)

    def summary(self) -> dict[str, object]:
        return {"cached_tables": cache_summary(self.rc, self.stats)}

    def close(self) -> None:
        self.rc.close()
