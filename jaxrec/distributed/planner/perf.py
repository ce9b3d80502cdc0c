"""Perf estimator: seconds per training step from bytes moved.

Compute is bytes read and written in device memory over ``hbm_mem_bw``;
communication is bytes a device sends through ``all_to_all`` (or receives
through ``all_gather``) over the intra- and cross-host bandwidths. Counts
follow jaxrec's collectives (``embedding_dist.py``):

- sharded width group with fast-path capacity ``C`` per (source,
  destination) and ``S`` slots on its fullest rank (padding included: shapes
  are static): forward the ids ``all_to_all`` (an int32 ``[N, P]`` array,
  ``P = C + min(S * B, C)``, plus ``C`` weights when weighted) and the lookup
  reading one row per received id (``K = N * C``); backward row gradients,
  sort-based de-duplication and the fused update reading and writing rows
  and optimizer state (the update's input_dist repeats the forward's with
  the same inputs, and XLA's CSE merges the two, so ids move once per step);
- per slot: the partial ``[N, B, columns]`` float32 blocks ``all_to_all``-ed
  back in the forward and their gradients in the backward (sequence
  collections: one ``[N, C, columns]`` block of rows per id, and ids only);
- a group holding column shards with a row-wise optimizer: each shard sends
  its per-row partial sums to the ``k - 1`` peers holding the same rows
  (``ppermute`` rounds of 4 bytes per value, ``storage.row_sum_values``);
- data parallel: a local lookup forward; backward an ``all_gather`` of every
  device's row gradients and a replicated update.

A ``fused_uvm_caching`` group costs the same lookups and updates (hits read
the device cache) plus, per row fetched on a miss, a host-to-device copy of
the row and its optimizer state and the copy back of the row it evicts, at
``hbm_to_ddr_mem_bw`` (``prefetch_compute``, TorchRec's name; rows fetched =
expected miss rate x ids received, see ``cache_stats.py``); the prefetch
pipeline may hide it behind compute, which is not modelled.

Ids beyond ``C`` take extra exchange rounds; the estimate assumes the fast
path holds them (the planner sizes ``C`` so that it does, see
``jaxrec.distributed.capacity``). Latency per collective, kernel launch
overhead and overlap between communication and compute are not modelled.
"""

from __future__ import annotations

from typing import NamedTuple

from .storage import F32, I32, Num, id_payload, slot_maps_on_device
from .topology import Topology

SORT_BYTES = 32  # de-duplication: a key/value sort, about four 8-byte passes per id


class Perf(NamedTuple):
    """Seconds, split as TorchRec's ``Perf``."""

    fwd_compute: float = 0.0
    fwd_comms: float = 0.0
    bwd_compute: float = 0.0
    bwd_comms: float = 0.0
    prefetch_compute: float = 0.0  # cache misses: rows copied in and evicted rows out

    @property
    def total(self) -> float:
        return (
            self.fwd_compute
            + self.fwd_comms
            + self.bwd_compute
            + self.bwd_comms
            + self.prefetch_compute
        )

    def __add__(self, other):  # element-wise, not tuple concatenation
        return Perf(*(a + b for a, b in zip(self, other, strict=True)))

    def scale(self, k: float) -> Perf:
        return Perf(*(a * k for a in self))


def sharded_perf(
    topo: Topology,
    ncols: int,
    itemsize: int,
    state_per_row: int,
    capacity,
    slots,
    *,
    weighted: bool = False,
    row_sum_sent: Num = 0.0,
    sequence: bool = False,
) -> Perf:
    """Seconds of one width group per step (``capacity`` and ``slots`` may be arrays).

    ``row_sum_sent``: float32 row sums the busiest rank sends its column peers.
    """
    n, b, hbm = topo.world_size, topo.batch_size, topo.hbm_mem_bw
    a2a = topo.all_to_all_seconds_per_byte()
    row = ncols * itemsize
    k = n * capacity
    ids = n * id_payload(capacity, slots, b, weighted, sequence) * I32  # one [N, P] int32 array
    block = n * (capacity if sequence else b * slots) * ncols * F32
    return Perf(
        fwd_compute=(k * row + 2 * ids + 2 * block) / hbm,
        fwd_comms=ids * a2a + block * a2a,
        bwd_compute=(k * (4 * ncols * F32 + SORT_BYTES + 2 * row + 2 * state_per_row) + 2 * block)
        / hbm,
        bwd_comms=block * a2a + row_sum_sent * F32 * topo.ppermute_seconds_per_byte(),
    )


def cache_miss_seconds(topo: Topology, fetched, row_bytes: int, ids=0):
    """Seconds to fetch ``fetched`` rows of ``row_bytes`` (columns and optimizer state)
    from host memory and write as many evicted rows back; they also pass through the
    device cache once each way. With the slot maps on the device (one host), the plan
    of the ``ids`` received reads each id's set (32 int32 rows) and writes its slot."""
    moved = 2 * fetched * row_bytes
    plan = ids * (32 * 4 + 3 * 4) if slot_maps_on_device(topo) else 0
    return moved / topo.hbm_to_ddr_mem_bw + (moved + plan) / topo.hbm_mem_bw


def replicated_perf(
    topo: Topology, dim: int, itemsize: int, state_per_row: int, ids: int, num_features: int
) -> Perf:
    """Seconds of one data-parallel table whose features hold ``ids`` ids per device."""
    n, b, hbm = topo.world_size, topo.batch_size, topo.hbm_mem_bw
    row = dim * itemsize
    grad = dim * F32 + 5  # row gradient, row id, valid flag
    return Perf(
        fwd_compute=(ids * (row + 8) + num_features * b * dim * F32) / hbm,
        fwd_comms=0.0,
        bwd_compute=(
            ids * 2 * grad + n * ids * (SORT_BYTES + 2 * grad + 2 * row + 2 * state_per_row)
        )
        / hbm,
        bwd_comms=ids * grad * topo.gather_seconds_per_byte(),
    )


def comm_bytes(placement, topo: Topology) -> dict[str, int]:
    """Operand bytes each device hands to collectives per step, by stage.

    The accounting of ``bench/sharded.py``'s ``plan_bytes`` for the exchange
    jaxrec runs: per width group ``N * P * 4`` bytes of ids (``P`` from
    ``storage.id_payload``), ``N * S * B * columns * 4`` of partial blocks
    forward and of their gradients backward, and for column-split tables with
    a row-wise optimizer ``4`` bytes per row sum the busiest rank sends its
    peers (``calls * (k - 1) * V_t`` per table of ``k`` column blocks);
    per data-parallel table ``ids * (4 + dim * 4 + 1)`` of gathered row
    gradients (sent to each of the ``N - 1`` peers).
    """
    n, b = topo.world_size, topo.batch_size
    out = {
        "ids_all_to_all": 0,
        "fwd_output_all_to_all": 0,
        "bwd_grad_all_to_all": 0,
        "dp_row_grad_all_gather": 0,
        "row_sum_exchange": 0,
    }
    for g in placement.groups:
        blocks = n * (g.capacity if g.sequence else g.slots * b) * g.key[1] * F32
        ids = id_payload(g.capacity, g.slots, b, g.weighted, g.sequence)
        out["ids_all_to_all"] += int(n * ids * I32)
        out["fwd_output_all_to_all"] += blocks
        out["bwd_grad_all_to_all"] += blocks
        out["row_sum_exchange"] += int(g.row_sum_sent * F32)
    for o in placement.options:
        if o.placement == "replicated":
            out["dp_row_grad_all_gather"] += o.table.ids * (4 + o.table.dim * F32 + 1)
    return out
