"""Storage estimator: device bytes of tables, optimizer state and lookup buffers.

Estimates follow what jaxrec allocates (see ``layout.py`` and
``embedding_dist.py``): shards of one ``(columns, dtype)`` width group are
stacked per rank and padded to the fullest rank, so a group costs, on every
device, ``R * (columns * itemsize + state bytes per row)`` for its largest
per-rank row count ``R``; its ``all_to_all`` buffers are ``[N, C]`` ids (three
4-byte arrays) for the largest per-destination id payload ``C`` and
``[N, S, B, columns]`` float32 partial blocks for the most slots ``S`` a rank
hosts. Data-parallel tables are full replicas plus an ``all_gather`` of every
device's row gradients.
"""

from __future__ import annotations

from typing import Any

from ...configs import DataType
from ...optim import SparseOptimizer
from .topology import Topology

DTYPE_BYTES = {DataType.FP32: 4, DataType.FP16: 2, DataType.BF16: 2}
ID_BYTES = 12  # input_dist sends rows (int32), segments (int32) and scales (float32)
F32 = 4


def _resolve_factory(name: str):
    from ... import optim

    factories = {
        "sgd": optim.sgd,
        "exact_sgd": optim.sgd,
        "adagrad": optim.adagrad,
        "exact_adagrad": optim.adagrad,
        "rowwise_adagrad": optim.rowwise_adagrad,
        "exact_rowwise_adagrad": optim.rowwise_adagrad,
        "adam": optim.adam,
        "partial_rowwise_adam": optim.partial_rowwise_adam,
        "lamb": optim.lamb,
        "partial_rowwise_lamb": optim.partial_rowwise_lamb,
        "lars_sgd": optim.lars_sgd,
    }
    key = name.lower()
    if key not in factories:
        raise ValueError(f"unknown optimizer {name!r}; use one of {sorted(factories)}")
    return factories[key]


def resolve_optimizer(optimizer: Any) -> Any:
    """A ``SparseOptimizer``, a ``CombinedOptimizer`` or a name (``"adam"``) -> optimizer."""
    if optimizer is None or isinstance(optimizer, str):
        return _resolve_factory(optimizer or "rowwise_adagrad")(0.01)
    return optimizer


def table_optimizer(optimizer: Any, table: str) -> SparseOptimizer:
    """The sparse optimizer that updates ``table``."""
    if hasattr(optimizer, "for_table"):  # CombinedOptimizer
        return optimizer.for_table(table)
    if not isinstance(optimizer, SparseOptimizer):
        raise TypeError(
            "optimizer must be a jaxrec.optim SparseOptimizer, a CombinedOptimizer or a name "
            f"such as 'rowwise_adagrad', got {type(optimizer).__name__}"
        )
    return optimizer


def _nbytes(tree) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def state_bytes_per_row(optimizer: SparseOptimizer, ncols: int, cache: dict | None = None) -> int:
    """Bytes of optimizer state per table row of ``ncols`` columns (shapes only, no arrays).

    E.g. 4 for row-wise Adagrad, ``8 * ncols`` for Adam, 0 for SGD.
    """
    key = (id(optimizer), ncols)
    if cache is not None and key in cache:
        return cache[key][1]
    import jax

    one = _nbytes(jax.eval_shape(lambda: optimizer.init(1, ncols)))
    two = _nbytes(jax.eval_shape(lambda: optimizer.init(2, ncols)))
    if cache is not None:
        cache[key] = (optimizer, two - one)  # keeps the optimizer alive: ids stay unique
    return two - one


def sharded_memory_coeffs(
    topo: Topology, ncols: int, itemsize: int, state_per_row: int
) -> tuple[float, float, float]:
    """Bytes per padded row, per id of per-destination capacity, per slot, of a width group.

    Per id: the send and receive ``[N, C]`` id buffers, the row gradients
    ``[N*C, columns]`` float32 with their de-duplicated copy, and the sort keys.
    Per slot: the forward partial blocks sent and received and the backward's
    gradient blocks, each ``[N, B, columns]`` float32.
    """
    n, b = topo.world_size, topo.batch_size
    per_row = ncols * itemsize + state_per_row
    per_id = n * (2 * ID_BYTES + 2 * ncols * F32 + 8)
    per_slot = 4 * n * b * ncols * F32
    return per_row, per_id, per_slot


def replicated_memory(
    topo: Topology, rows: int, dim: int, itemsize: int, state_per_row: int, ids: int
) -> tuple[float, float, float]:
    """``(weights, state, buffers)`` bytes of a data-parallel table on every device.

    ``ids`` is the table's features' capacity per device; the backward gathers
    every device's row gradients (ids, ``[ids, dim]`` float32, mask) and
    de-duplicates them.
    """
    n = topo.world_size
    gathered = n * ids * (2 * dim * F32 + 4 + 1 + 8)
    return rows * dim * itemsize, rows * state_per_row, gathered


def format_bytes(x: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"
