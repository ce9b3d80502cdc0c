"""Storage estimator: device bytes of tables, optimizer state and lookup buffers.

Estimates follow what jaxrec allocates (see ``layout.py`` and
``embedding_dist.py``) and what XLA's GPU compiler keeps live at the step's
peak (checked against ``memory_analysis()`` of train steps compiled for
H100s, ``tests/gpu_compile/test_gpu_compile_train_step.py``). Shards of one
``(columns, dtype)`` width group are stacked per rank and padded to the
fullest rank, so a group costs, on every device, ``R * (columns * itemsize +
state bytes per row)`` for its largest per-rank row count ``R``; its lookup
buffers scale with the group's fast-path id capacity ``C`` per (source,
destination) and the most slots ``S`` a rank hosts (see
:func:`sharded_buffer_bytes`). ``C`` is sized from input statistics
(``jaxrec.distributed.capacity``), not the worst case: ids beyond it take
extra exchange rounds, which cost time, not memory. Buffers are
summed over groups: XLA schedules every group's backward before the updates
that free them, so their row gradients are live together. Data-parallel
tables are full replicas plus an ``all_gather`` of every device's row
gradients.

A ``fused_uvm_caching`` group holds, per rank, a device cache of ``ceil(load_factor
* shard rows)`` slots per shard (a slot: the row's columns and optimizer state) in
HBM, and the shards' rows with their state in host memory beside the cache's
metadata (:func:`cache_host_bytes`); both are padded to the group's fullest rank.
"""

from __future__ import annotations

import numpy as np

from ... import optim
from ...configs import DataType
from ...embedding.optimizer import CombinedOptimizer
from ...optim import SparseOptimizer
from ..types import cache_slots as cache_slots
from .topology import Topology

DTYPE_BYTES = {DataType.FP32: 4, DataType.FP16: 2, DataType.BF16: 2}
I32 = 4
F32 = 4
# De-duplication sorts (row, position) int32 pairs. XLA hands sorts of more than
# 16,384 keys to CUB's radix sort (DeviceRadixSort::SortPairs with separate input
# and output arrays), whose scratch holds another copy of keys and values plus a
# few KiB of histograms; compiled without a GPU (xla_gpu_enable_cub_radix_sort
# off) the compiler's figures lack it, so it is counted here explicitly.
SORT_BYTES = 8
CUB_SCRATCH_BYTES = 8
# A cached shard's slot map. With one host (jaxrec.cache's default, slot_maps="device")
# it is on the device, set-associative (jaxrec.cache.sets): per slot its row and last
# use (int32 each), per row an LFU count (int32; counted for either policy), and the
# plan's temporaries per id received: its set's 32 rows read and compared (int32 + bool
# each) and a sort of (set, row, position). With several hosts the maps stay on the host:
# the slot of every table row (int32, -1 when not cached), and per slot its row (int64)
# and LRU stamp or LFU count (int64).
SLOT_MAP_BYTES = 8
SLOT_MAP_ROW_BYTES = 4
SLOT_PLAN_ID_BYTES = 32 * (4 + 1) + 12
ROW_TO_SLOT_BYTES = 4
SLOT_META_BYTES = 16

# A Python number or a numpy array of them: the estimators price many ranks at once.
Num = float | np.ndarray
# What a planner is told its tables train with: an optimizer, or a name (None: the default).
OptimizerSpec = SparseOptimizer | CombinedOptimizer | str | None


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


def resolve_optimizer(optimizer: OptimizerSpec) -> SparseOptimizer | CombinedOptimizer:
    """A ``SparseOptimizer``, a ``CombinedOptimizer`` or a name (``"adam"``) -> optimizer."""
    if optimizer is None or isinstance(optimizer, str):
        return _resolve_factory(optimizer or "rowwise_adagrad")(0.01)
    return optimizer


def table_optimizer(optimizer: SparseOptimizer | CombinedOptimizer, table: str) -> SparseOptimizer:
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


def id_payload(capacity, slots, batch: int, weighted: bool, sequence: bool = False):
    """Int32 entries per (source, destination) of a width group's ids ``all_to_all``.

    ``P = C + M (+ C weighted)``: the fast path's ``C`` local rows, ``M =
    min(S * B, C)`` segment entries (per-(slot, bag) counts or per-id segments,
    whichever is smaller) and, for a weighted collection, ``C`` float32
    weights; a sequence collection sends the rows only (``P = C``).
    ``capacity`` and ``slots`` may be numpy arrays.
    """
    if sequence:
        return capacity + 0 * slots
    return capacity + np.minimum(slots * batch, capacity) + (capacity if weighted else 0)


def sharded_buffer_bytes(
    topo: Topology,
    ncols: int,
    capacity,
    slots,
    *,
    weighted: bool = False,
    split: bool = False,
    row_sum_values: Num = 0.0,
    sequence: bool = False,
):
    """Lookup buffer bytes of one width group on every device (numpy-friendly).

    With ``N`` devices, ``B`` samples per device, fast-path capacity ``C`` per
    (source, destination) and ``S`` slots on the fullest rank:

    - the ids ``all_to_all``: one int32 ``[N, P]`` array sent and one received
      (``P`` from :func:`id_payload`): ``2 * N * P * 4``;
    - per received id (``K = N * C``): the de-duplicated float32 row gradients
      (``4 * columns``; XLA fuses the per-id gradients' gather and scale into
      the segment sum, so only the summed copy is materialised), the sort's
      (row, position) pair and CUB's scratch for it: ``K * (4 * columns + 16)``;
    - the partial pooled blocks, ``[N, S, B, columns]`` float32: three copies,
      ``3 * N * S * B * columns * 4`` (a send and a receive buffer, and the
      backward's received gradient blocks, which the update reads until its
      overflow loop ends; XLA:GPU held three to four of them in
      ``bench/sharded.py``'s row-wise step, whose other buffers the rest of this
      estimate over-counts); a sequence collection (``sequence``) moves one row
      per id instead, ``[N, C, columns]``, counted three times alike;
    - a group holding column shards is updated by the XLA path, which
      materialises its updated rows (``K * columns * 4``), or, before them and
      larger, the row-sum vectors of a row-wise optimizer: ``2 * 4`` bytes
      (input and output) per value exchanged (``row_sum_values``: the largest
      over ranks of ``calls * sum over its column-split shards of N *
      min(C, sum of the table's feature capacities)``).
    """
    parts = sharded_buffer_parts(
        topo,
        ncols,
        capacity,
        slots,
        weighted=weighted,
        split=split,
        row_sum_values=row_sum_values,
        sequence=sequence,
    )
    return parts["ids"] + parts["received"] + parts["blocks"] + parts["column_split"]


def sharded_buffer_parts(
    topo: Topology,
    ncols: int,
    capacity,
    slots,
    *,
    weighted: bool = False,
    split: bool = False,
    row_sum_values: Num = 0.0,
    sequence: bool = False,
) -> dict:
    """:func:`sharded_buffer_bytes` by part: ``ids`` (the ids ``all_to_all``),
    ``received`` (per received id), ``blocks`` and ``column_split``."""
    n, b = topo.world_size, topo.batch_size
    k = n * capacity
    extra = np.maximum(k * ncols * F32, 2 * F32 * row_sum_values) if split else 0 * k
    per_source = capacity if sequence else slots * b  # rows per id, or blocks per bag
    return {
        "ids": 2 * n * id_payload(capacity, slots, b, weighted, sequence) * I32,
        "received": k * (ncols * F32 + SORT_BYTES + CUB_SCRATCH_BYTES),
        "blocks": 3 * n * per_source * ncols * F32,
        "column_split": extra,
    }


def row_sum_values(world_size: int, capacity: int, table_ids: int, calls: int) -> int:
    """Float32 values one column shard of a table exchanges with its peers per step.

    A row-wise optimizer (row-wise Adagrad, LAMB, ...) completes each per-row
    sum across the column shards holding the same rows: every shard sends
    them one value per unique row it received, at most ``N * min(C, ids)``
    (``ids``: the sum of the table's feature capacities), per reduction the
    optimizer makes (``calls``).
    """
    return calls * world_size * min(capacity, table_ids)


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


def slot_maps_on_device(topo: Topology) -> bool:
    """Whether cached tables' slot maps are priced on the device (one host: what
    ``jaxrec.cache.RowCache`` does with one process off the CPU) or on the host."""
    return topo.num_hosts == 1


def cache_host_bytes(rows, slots, row_bytes: int, device_maps: bool = True):
    """Host bytes of cached shards: ``rows`` rows of ``row_bytes`` (columns and optimizer
    state), and with the slot maps on the host (``device_maps=False``: several hosts)
    their row -> slot map and the metadata of ``slots`` slots."""
    if device_maps:
        return rows * row_bytes
    return rows * (row_bytes + ROW_TO_SLOT_BYTES) + slots * SLOT_META_BYTES


def cache_map_bytes(rows, slots, device_maps: bool = True):
    """Device bytes of cached shards' slot maps (none when they are on the host)."""
    return rows * SLOT_MAP_ROW_BYTES + slots * SLOT_MAP_BYTES if device_maps else 0


def cache_staging_bytes(topo: Topology, capacity, row_bytes: int):
    """Device bytes staging a cached group's copies: the rows fetched on misses and
    the rows evicted, each as many as the ids received (``N * C``; shapes are static),
    and with the slot maps on the device their plan's temporaries per id."""
    ids = topo.world_size * capacity
    plan = ids * SLOT_PLAN_ID_BYTES if slot_maps_on_device(topo) else 0
    return 2 * ids * row_bytes + plan


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
