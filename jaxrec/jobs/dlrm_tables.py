"""Where the DLRM job's tables live, and what that changes in a run: all on the
devices (:class:`DeviceTables`), or some in host memory behind a device cache
(:class:`CachedTables`, TorchRec's ``fused_uvm_caching``). The job's steps call
these and never ask which they have."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..cache import CachedTrainStep, RowCache, prefetching
from ..checkpoint import CheckpointManager
from ..embedding import CombinedOptimizer
from .dlrm_cache import cache_summary
from .dlrm_config import DlrmJobConfig
from .dlrm_parts import evaluate, evaluate_cached


class Tables(Protocol):
    """What a run does with its tables' rows: train, evaluate, checkpoint, report."""

    def wrap(self, step: Callable, to_device: Callable) -> tuple[Callable, Callable]:
        """``(step, to_device)`` as the pipeline runs them."""
        ...

    def resume(self, ckpt: CheckpointManager, state: Any) -> tuple[Any, int]:
        """``(state, step)`` of the newest intact checkpoint."""
        ...

    def save(self, ckpt: CheckpointManager, at: int, state: Any) -> None: ...

    def evaluate(
        self, eval_step: Callable, state: Any, data: Any, config: DlrmJobConfig, mesh: Any
    ) -> tuple[dict[str, float], Any]:
        """``(metrics, state)``: go on with the state returned."""
        ...

    def summary(self) -> dict[str, Any]:
        """The summary's entries about the tables (none for device tables)."""
        ...

    def close(self) -> None: ...


class DeviceTables:
    """Every table on the devices: the train state holds all of it."""

    def __init__(self, graphdef: Any, optimizer: CombinedOptimizer):
        self.graphdef, self.optimizer = graphdef, optimizer

    def wrap(self, step: Callable, to_device: Callable) -> tuple[Callable, Callable]:
        return step, to_device

    def resume(self, ckpt: CheckpointManager, state: Any) -> tuple[Any, int]:
        return ckpt.resume(self.graphdef, self.optimizer, state)

    def save(self, ckpt: CheckpointManager, at: int, state: Any) -> None:
        ckpt.save(at, self.graphdef, self.optimizer, state, force=True)

    def evaluate(
        self, eval_step: Callable, state: Any, data: Any, config: DlrmJobConfig, mesh: Any
    ) -> tuple[dict[str, float], Any]:
        return evaluate(eval_step, state, data, config, mesh), state

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class CachedTables:
    """Some tables in host memory, their rows cached on the devices (``rc``): each
    batch's rows are planned and gathered a batch ahead, checkpoints hold the host
    tables. ``stats``: the planner's measured miss rates, for the summary."""

    def __init__(self, rc: RowCache, stats: dict | None, config: DlrmJobConfig):
        self.rc, self.stats = rc, stats
        k = config.grad_accumulation
        if k > 1:
            raise SystemExit(f"--grad-accumulation {k} does not take cached tables")
        if config.pipeline != "sync":
            raise SystemExit(f"--pipeline {config.pipeline} does not take cached tables: use sync")

    def wrap(self, step: Callable, to_device: Callable) -> tuple[Callable, Callable]:
        return CachedTrainStep(step, self.rc), prefetching(self.rc, to_device)

    def resume(self, ckpt: CheckpointManager, state: Any) -> tuple[Any, int]:
        return self.rc.resume(ckpt, state)  # the host tables restored, the cache empty

    def save(self, ckpt: CheckpointManager, at: int, state: Any) -> None:
        self.rc.save(ckpt, at, state, force=True)  # the cache flushed first

    def evaluate(
        self, eval_step: Callable, state: Any, data: Any, config: DlrmJobConfig, mesh: Any
    ) -> tuple[dict[str, float], Any]:
        return evaluate_cached(eval_step, state, data, config, mesh, self.rc)

    def summary(self) -> dict[str, Any]:
        return {"cached_tables": cache_summary(self.rc, self.stats)}

    def close(self) -> None:
        self.rc.close()
