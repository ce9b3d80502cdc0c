"""Perf estimator: seconds per training step from bytes moved.

Compute is bytes read and written in device memory over ``hbm_mem_bw``;
communication is bytes a device sends through ``all_to_all`` (or receives
through ``all_gather``) over the intra- and cross-host bandwidths. Counts
follow jaxrec's collectives (``embedding_dist.py``):

- sharded width group, per id of per-destination capacity ``C`` (``N * C``
  entries on every device, padding included: shapes are static):
  forward ``all_to_all`` of ids, the lookup reading one row per id; backward
  row gradients, sort-based de-duplication and the fused update reading and
  writing rows and optimizer state (the update's input_dist repeats the
  forward's with the same inputs, and XLA's CSE merges the two, so ids move
  once per step: ``bench/sharded.py`` checks this against the HLO);
- per slot (a feature reading a shard) on the busiest rank: the partial
  ``[N, B, columns]`` float32 blocks ``all_to_all``-ed back in the forward and
  their gradients in the backward;
- data parallel: a local lookup forward; backward an ``all_gather`` of every
  device's row gradients and a replicated update.

Latency per collective, kernel launch overhead and overlap between
communication and compute are not modelled.
"""

from __future__ import annotations

from typing import NamedTuple

from .storage import F32, ID_BYTES
from .topology import Topology

SORT_BYTES = 32  # de-duplication: a key/value sort, about four 8-byte passes per id


class Perf(NamedTuple):
    """Seconds, split as TorchRec's ``Perf``."""

    fwd_compute: float = 0.0
    fwd_comms: float = 0.0
    bwd_compute: float = 0.0
    bwd_comms: float = 0.0

    @property
    def total(self) -> float:
        return self.fwd_compute + self.fwd_comms + self.bwd_compute + self.bwd_comms

    def __add__(self, other):  # element-wise, not tuple concatenation
        return Perf(*(a + b for a, b in zip(self, other, strict=True)))

    def scale(self, k: float) -> Perf:
        return Perf(*(a * k for a in self))


def sharded_perf_coeffs(
    topo: Topology, ncols: int, itemsize: int, state_per_row: int
) -> tuple[Perf, Perf]:
    """``(per id of capacity C, per slot S)`` seconds of one width group."""
    n, b, hbm = topo.world_size, topo.batch_size, topo.hbm_mem_bw
    a2a = topo.all_to_all_seconds_per_byte()
    row = ncols * itemsize
    per_id = Perf(
        fwd_compute=n * (row + ID_BYTES) / hbm,
        fwd_comms=n * ID_BYTES * a2a,
        bwd_compute=n * (4 * ncols * F32 + SORT_BYTES + 2 * row + 2 * state_per_row) / hbm,
        bwd_comms=0.0,
    )
    block = n * b * ncols * F32
    per_slot = Perf(
        fwd_compute=2 * block / hbm, fwd_comms=block * a2a,
        bwd_compute=2 * block / hbm, bwd_comms=block * a2a,
    )  # fmt: skip
    return per_id, per_slot


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

    The same accounting as ``bench/sharded.py``'s ``plan_bytes`` (checked
    there against the compiled HLO): per width group ``3 * N * C * 4`` bytes
    of ids, ``N * S * B * columns * 4`` of partial blocks forward and of their
    gradients backward; per data-parallel table ``ids * (4 + dim * 4 + 1)``
    of gathered row gradients (sent to each of the ``N - 1`` peers).
    """
    n, b = topo.world_size, topo.batch_size
    out = {"ids_all_to_all": 0, "fwd_output_all_to_all": 0, "bwd_grad_all_to_all": 0,
           "dp_row_grad_all_gather": 0}  # fmt: skip
    for g in placement.groups:
        blocks = n * g.slots * b * g.key[1] * F32
        out["ids_all_to_all"] += int(n * g.ids_per_destination * ID_BYTES)
        out["fwd_output_all_to_all"] += blocks
        out["bwd_grad_all_to_all"] += blocks
    for o in placement.options:
        if o.placement == "replicated":
            out["dp_row_grad_all_gather"] += o.table.ids * (4 + o.table.dim * F32 + 1)
    return out
