"""Storage estimator: device bytes of tables, optimizer state and lookup buffers.

Estimates follow what jaxrec allocates (see ``layout.py`` and
``embedding_dist.py``) and what XLA's GPU compiler keeps live at the step's
peak (checked against ``memory_analysis()`` of train steps compiled for
H100s, ``tests/gpu_compile/test_gpu_compile_train_step.py``). Shards of one
``(columns, dtype)`` width group are stacked per rank and padded to the
fullest rank, so a group costs, on every device, ``R * (columns * itemsize +
state bytes per row)`` for its largest per-rank row count ``R``; its lookup
buffers scale with the largest per-destination id payload ``C`` and the most
slots ``S`` a rank hosts (see :func:`sharded_memory_coeffs`). Buffers are
summed over groups: XLA schedules every group's backward before the updates
that free them, so their row gradients are live together. Data-parallel
tables are full replicas plus an ``all_gather`` of every device's row
gradients.
"""

from __future__ import annotations

from typing import Any

from ... import optim
from ...configs import DataType
from ...embedding.optimizer import CombinedOptimizer
from ...optim import SparseOptimizer
from .topology import Topology

DTYPE_BYTES = {DataType.FP32: 4, DataType.FP16: 2, DataType.BF16: 2}
ID_BYTES = 12  # input_dist sends rows (int32), segments (int32) and scales (float32)
F32 = 4
# De-duplication sorts (row, position) int32 pairs. XLA hands sorts of more than
# 16,384 keys to CUB's radix sort (DeviceRadixSort::SortPairs with separate input
# and output arrays), whose scratch holds another copy of keys and values plus a
# few KiB of histograms; compiled without a GPU (xla_gpu_enable_cub_radix_sort
# off) the compiler's figures lack it, so it is counted here explicitly.
SORT_BYTES = 8
CUB_SCRATCH_BYTES = 8


def _resolve_factory(name: str):
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
    if isinstance(optimizer, CombinedOptimizer):
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
) -> tuple[float, float, float, float]:
    """Bytes per padded row, per id of per-destination capacity (plus the extra per
    id of a group holding column shards), per slot, of a width group.

    Per id: the send and receive ``[N, C]`` id buffers, one ``[N*C, columns]``
    float32 array of row gradients (XLA fuses the per-id gradients' gather and
    scale into the de-duplicating segment sum, so only the summed copy is
    materialised), the sort's keys and values and CUB's scratch for them. A
    group with column shards is updated by the XLA path (its row-wise sums
    cross shards mid-update), which materialises the updated rows: another
    ``[N*C, columns]`` float32. Per slot: one ``all_to_all``'s send and receive
    blocks, ``[N, B, columns]`` float32 each (the forward's partial blocks and
    the backward's gradient blocks are never live together).
    """
    n, b = topo.world_size, topo.batch_size
    per_row = ncols * itemsize + state_per_row
    per_id = n * (2 * ID_BYTES + ncols * F32 + SORT_BYTES + CUB_SCRATCH_BYTES)
    per_id_split = n * ncols * F32
    per_slot = 2 * n * b * ncols * F32
    return per_row, per_id, per_id_split, per_slot


def row_sum_bytes(table_rows: int, reductions: int) -> int:
    """Bytes on every device of the per-row sums of one column-split table.

    A row-wise optimizer (row-wise Adagrad, LAMB, ...) completes each per-row
    sum across column shards with a ``psum`` of a float32 vector over the
    table's logical rows (``jaxrec/distributed/row_sums.py``): the scattered
    input and the all-reduced output, per reduction the optimizer makes.
    """
    return reductions * 2 * F32 * table_rows


def row_sum_calls(optimizer: SparseOptimizer, cache: dict | None = None) -> int:
    """How many per-row sums across column shards ``optimizer.update`` makes per step."""
    key = ("row_sum", id(optimizer))
    if cache is not None and key in cache:
        return cache[key][1]
    import jax
    import jax.numpy as jnp

    calls = []

    def row_sum(x):
        calls.append(x.shape)
        return x

    def update():
        rows = jnp.zeros((2, 4), jnp.float32)
        state = optimizer.init(2, 4)  # 2 rows: the state slices of the 2 rows updated
        return optimizer.update(rows, rows, state, jnp.int32(1), dim=4, row_sum=row_sum)

    jax.eval_shape(update)
    if cache is not None:
        cache[key] = (optimizer, len(calls))
    return len(calls)


def replicated_memory(
    topo: Topology, rows: int, dim: int, itemsize: int, state_per_row: int, ids: int
) -> tuple[float, float, float]:
    """``(weights, state, buffers)`` bytes of a data-parallel table on every device.

    ``ids`` is the table's features' capacity per device; the backward gathers
    every device's row gradients (ids, ``[ids, dim]`` float32, mask) and
    de-duplicates them. XLA:GPU keeps up to three ``[N * ids, dim]`` float32
    arrays live: the gathered gradients, them masked to valid ids (a
    collective's result is not fused into the segment sum) and their sums. The
    DLRM of tests/gpu_compile (D=128, 20 ids per bag) held two, bench/sharded.py's
    (D=64, 10 ids per bag) three at every table count: three are counted, as an
    estimate below the compiler's would accept plans that do not fit.
    """
    n = topo.world_size
    gathered = n * ids * (3 * dim * F32 + 4 + 1 + SORT_BYTES + CUB_SCRATCH_BYTES)
    return rows * dim * itemsize, rows * state_per_row, gathered


def format_bytes(x: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"
