"""TorchRec's collective bytes per training step, for any sharding plan (no torch needed).

What TorchRec's sharded ``EmbeddingBagCollection`` moves per step for a plan,
table by table, as per-device averages (each stage's bytes summed over the
devices, divided by their number). Ids and lengths move with variable-size
``all_to_all``s (no padding), ids at 4 bytes as jaxrec's. Per table of ``F``
features, ``D`` columns, ``ids`` mean ids and ``bags`` bags per device, ``B``
samples per device, ``N`` devices, ``L`` per host:

- table-wise / column-wise / table-column-wise (``k`` column blocks): ids and
  lengths to every block, ``k * (ids + bags) * 4``; the pooled outputs
  ``all_to_all``-ed home, ``B * D * F * 4`` (and their gradients back);
- row-wise over ``m`` ranks: ids and one length per bag per bucket,
  ``(ids + m * bags) * 4``; a reduce-scatter of every holder's ``[N * B, D]``
  partial sums, ``m * B * D * F * 4`` (TorchRec's row-wise uses all ``N``
  ranks; a table jaxrec's planner cut over fewer ranks is priced with its
  ``m`` holders), and an all-gather of the gradients back, ``B * D * F * 4``
  (to the ``m`` holders: on the wire ``m`` times it, ``N - 1`` when ``m = N``);
- table-row-wise / grid (``h`` column blocks, each over ``m`` ranks of a
  host): ids ``h * (ids + m * bags) * 4``; forward a reduce-scatter within the
  host (``m * B * D * F * 4``) then an ``all_to_all`` across hosts
  (``B * D * F * 4``); backward the reverse (``all_to_all`` then all-gather,
  ``B * D * F * 4`` each);
- data parallel: DDP's all-reduce of the dense table gradient, ``rows * D``
  elements of the table's dtype.

"Wire" bytes are what a device sends under the usual algorithms:
``all_to_all`` and reduce-scatter ``(g-1)/g`` of the operand, all-gather
``g - 1`` times it, all-reduce ``2(g-1)/g``, for a group of ``g`` devices
(the world, a host's ``L``, or the ``N / L`` hosts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from jaxrec.distributed import ParameterSharding, ShardingType

ST = ShardingType
I32 = 4


def wire_factor(kind: str, group: int) -> float:
    """Bytes a device sends per operand byte of a collective over ``group`` devices."""
    if group <= 1:
        return 0.0
    return {
        "all-to-all": (group - 1) / group,
        "reduce-scatter": (group - 1) / group,
        "all-gather": group - 1,
        "all-reduce": 2 * (group - 1) / group,
        "ppermute": 1.0,
    }[kind]


@dataclasses.dataclass(frozen=True)
class TableInputs:
    """One table and its inputs per device: ``ids`` mean ids, ``bags`` bags (both
    summed over its features)."""

    rows: int
    dim: int
    itemsize: int  # bytes per element of the table (its dense gradient under DDP)
    features: int
    ids: float
    bags: float


class Part(NamedTuple):
    stage: str
    kind: str  # all-to-all, reduce-scatter, all-gather, all-reduce
    bytes: float  # operand bytes per device (average)
    group: int


def table_parts(
    sharding: ParameterSharding,
    t: TableInputs,
    *,
    world: int,
    local: int,
    batch: int,
    pooled_itemsize: int = 4,
) -> list[Part]:
    """TorchRec's collectives for one table under ``sharding`` (see the module docstring)."""
    kind = sharding.sharding_type
    if kind is ST.DATA_PARALLEL:
        return [Part("table_grad", "all-reduce", t.rows * t.dim * t.itemsize, world)]
    shards = [s for s in sharding.sharding_spec if s.shard_sizes[0] and s.shard_sizes[1]]
    blocks = len({s.shard_offsets[1] for s in shards})  # column blocks
    pooled = batch * t.dim * t.features * pooled_itemsize  # this device's outputs
    ids = t.ids + t.bags  # values and one length per bag
    hosts = world // local
    if kind in (ST.TABLE_WISE, ST.COLUMN_WISE, ST.TABLE_COLUMN_WISE):
        return [
            Part("ids", "all-to-all", blocks * ids * I32, world),
            Part("fwd_output", "all-to-all", pooled, world),
            Part("bwd_grad", "all-to-all", pooled, world),
        ]
    per_block = len(shards) // blocks  # row shards per column block
    bucketed = (t.ids + per_block * t.bags) * I32  # lengths per bucket
    if kind is ST.ROW_WISE:
        return [
            Part("ids", "all-to-all", bucketed, world),
            Part("fwd_output", "reduce-scatter", per_block * pooled, world),
            # every device's gradients reach the m holders: factor m (N - 1 when m = N)
            Part("bwd_grad", "all-gather", pooled, min(world, per_block + 1)),
        ]
    if kind in (ST.TABLE_ROW_WISE, ST.GRID_SHARD):
        return [
            Part("ids", "all-to-all", blocks * bucketed, world),
            Part("fwd_intra_host", "reduce-scatter", per_block * pooled, local),
            Part("fwd_cross_host", "all-to-all", pooled, hosts),
            Part("bwd_cross_host", "all-to-all", pooled, hosts),
            Part("bwd_intra_host", "all-gather", pooled, local),
        ]
    raise ValueError(f"no TorchRec scheme for {kind}")


def plan_parts(
    plan: Mapping[str, ParameterSharding],
    inputs: Mapping[str, TableInputs],
    *,
    world: int,
    local: int,
    batch: int,
    pooled_itemsize: int = 4,
) -> list[Part]:
    """Every table's parts (``plan``: one module's ``{table: ParameterSharding}``)."""
    out = []
    for name, sharding in plan.items():
        out += table_parts(
            sharding,
            inputs[name],
            world=world,
            local=local,
            batch=batch,
            pooled_itemsize=pooled_itemsize,
        )
    return out


def summarize(parts: Iterable[Part]) -> dict:
    """``{"stages": {stage: bytes}, "operand": bytes, "wire": bytes}`` per device."""
    stages: dict[str, float] = {}
    operand = wire = 0.0
    for p in parts:
        stages[p.stage] = stages.get(p.stage, 0.0) + p.bytes
        operand += p.bytes
        wire += p.bytes * wire_factor(p.kind, p.group)
    return {
        "stages": {k: int(v) for k, v in stages.items()},
        "operand": int(operand),
        "wire": int(wire),
    }
