"""Printed planner output: per-device memory and time, each table's choice, and
the explanation of an infeasible problem."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from ... import optim
from ..capacity import fast_path_capacity
from ..types import ShardingType
from .cost_model import CostModel
from .options import ShardingOption, TableInfo
from .perf import comm_bytes
from .placement import Placement
from .storage import format_bytes as fb
from .storage import sharded_buffer_parts


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def _ranks(ranks: Sequence[int]) -> str:
    rs = sorted(set(ranks))
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


SHOWN = 8  # tables listed in an infeasibility report


class PlanStats:
    """The planner's report on its chosen plan; ``str()`` is the printed table."""

    def __init__(
        self,
        placed: Placement,
        cost: CostModel,
        reserved: float,
        counts: Mapping,
        winner: str,
        seconds: float,
    ):
        self.placement = placed
        self.cost = cost
        self.reserved = reserved
        self.proposals = dict(counts)
        self.winner = winner
        self.seconds = seconds

    @property
    def comm_bytes(self) -> dict[str, int]:
        """Operand bytes each device hands to collectives per step, by stage."""
        return comm_bytes(self.placement, self.cost.topology)

    @property
    def buffer_bytes(self) -> dict[str, float]:
        """Per-device lookup buffers by part: ``ids`` (the id ``all_to_all`` arrays),
        ``received`` (per received id: row gradients, sort, scratch), ``blocks``
        (partial pooled blocks), ``column_split`` (updated rows or row sums) and
        ``data_parallel`` (gathered row gradients); they sum to ``memory[2]``."""
        topo = self.cost.topology
        out = {"ids": 0.0, "received": 0.0, "blocks": 0.0, "column_split": 0.0}
        for g in self.placement.groups:
            parts = sharded_buffer_parts(
                topo,
                g.key[1],
                g.capacity,
                g.slots,
                weighted=g.weighted,
                split=g.column_split,
                sequence=g.sequence,
                row_sum_values=g.row_sum_values,
            )
            for k, v in parts.items():
                out[k] += float(v)
        out["data_parallel"] = self.placement.memory[2] - sum(out.values())
        return out

    @property
    def capacities(self) -> dict[str, dict[str, int]]:
        """``{module path: {group name: C}}``: the fast-path id capacity per (source,
        destination) each width group's buffers are sized for (group names as
        ``layout.py`` builds them, e.g. ``"fp32_c64"``)."""
        return self.placement.capacities

    def warnings(self) -> list[str]:
        out = capacity_errors(self.placement, self.cost, warn=True)
        for g in self.placement.groups:
            if len(g.optimizers) > 1:
                out.append(
                    f"width group {g.key} mixes optimizers {list(g.optimizers)} (tables "
                    f"{list(g.tables)}): ShardedEmbeddingBagCollection needs one optimizer per "
                    "(dim, dtype) group"
                )
        return out

    def __str__(self) -> str:
        p, topo = self.placement, self.cost.topology
        mem, perf = p.memory, p.perf
        opts = sorted({o.table.optimizer.name for o in p.options})
        lines = [
            f"jaxrec sharding plan: {len(p.options)} tables on {topo.world_size} devices "
            f"({topo.num_hosts} host(s) x {topo.local_world_size}), {topo.compute_device}, "
            f"batch {topo.batch_size} per device",
            f"HBM {fb(topo.hbm_cap)} per device, {fb(p.usable_bytes)} usable "
            f"({self.reserved:.0%} reserved); optimizer state sized for {', '.join(opts)}",
            "proposals evaluated: "
            + ", ".join(f"{k} {v}" for k, v in self.proposals.items())
            + f"; best from {self.winner}; planned in {self.seconds:.2f} s",
            "",
            "per device, padded as jaxrec allocates (every device runs the same shapes):",
            f"  HBM: tables {fb(mem[0])} + optimizer state {fb(mem[1])} + buffers {fb(mem[2])}"
            f" = {fb(p.hbm)} of {fb(p.usable_bytes)} ({p.hbm / p.usable_bytes:.1%})",
            f"  step estimate {_ms(perf.total)} ms = fwd compute {_ms(perf.fwd_compute)} + fwd "
            f"comms {_ms(perf.fwd_comms)} + bwd compute {_ms(perf.bwd_compute)} + bwd comms "
            f"{_ms(perf.bwd_comms)}"
            + (f" + cache misses {_ms(perf.prefetch_compute)}" if perf.prefetch_compute else ""),
            "  collective operand bytes per device per step: "
            + ", ".join(f"{k} {fb(v)}" for k, v in comm_bytes(p, topo).items() if v),
        ]
        lo = topo.ranks_per_host
        if p.cached:
            lines.insert(
                -1,
                (
                    f"  host memory (cached tables: rows, optimizer state, cache metadata): "
                    f"{fb(p.ddr)} per device, {fb(p.ddr * lo)} per host of {fb(p.usable_ddr * lo)} "
                    f"usable ({p.ddr / p.usable_ddr:.1%}; ddr_cap {fb(topo.ddr_cap)})"
                ),
            )
        host_col = " | own host (unpadded)" if p.cached else ""
        lines += ["", f" rank | own HBM (unpadded) | own time (ms) | shards{host_col}"]
        shards = [0] * topo.world_size
        for o, rs in zip(p.options, p.shard_ranks, strict=True):
            if o.placement == "replicated":
                rs, specs = range(topo.world_size), [o.shards[0]] * topo.world_size
            else:
                specs = o.shards
            for s, r in zip(specs, rs, strict=True):
                if s.nrows and s.ncols:
                    shards[r] += 1
        for r in range(topo.world_size):
            host = f" | {fb(p.own_ddr[r]):>19}" if p.cached else ""
            lines.append(
                f" {r:>4} | {fb(p.own_memory[r]):>18} | {_ms(p.own_perf[r]):>13} | {shards[r]}"
                + host
            )
        lines.append(f" balance (max / mean own time): {p.balance:.3f}")
        own = sum(p.own_memory) / len(p.own_memory)
        lines.append(
            f" padding (padded HBM / mean own HBM): {p.hbm / own if own else 1.0:.3f}; "
            f"{len(p.split)} table-wise table(s) cut by rows to balance their width groups"
        )
        lines += [
            "",
            " table | rows x dim | sharding | ranks | largest shard | standalone ms",
        ]
        for o, rs in zip(p.options, p.shard_ranks, strict=True):
            t = o.table
            lines.append(
                f" {t.key} | {t.rows} x {t.dim} {t.config.data_type.value} | {o.label} | "
                f"{_ranks(rs)} | {fb(o.per_device_bytes)} | {_ms(o.perf)}"
            )
        if p.groups:
            lines += [
                "",
                " width group | rows/rank | expected ids/destination | capacity | "
                "natural | slots | HBM | ms",
            ]
            for g in p.groups:
                where = f"{g.key[0]}: " if g.key[0] else ""
                lines.append(
                    f" {where}{g.name} | {g.rows_per_rank} | {g.expected_ids:.0f} | "
                    f"{g.capacity} | {g.natural_ids} | {g.slots} | {fb(sum(g.memory))} | "
                    f"{_ms(g.perf.total)}"
                )
                if g.cached:
                    lines.append(
                        f"   cache: {g.cache_rows} slots/rank, {g.fetched:.0f} rows fetched per "
                        f"step on the busiest rank ({_ms(g.perf.prefetch_compute)} ms), host "
                        f"{fb(g.host)}/rank"
                    )
        for w in self.warnings():
            lines.append(f"WARNING: {w}")
        return "\n".join(lines)


def capacity_errors(placed: Placement, cost: CostModel, warn: bool = False) -> list[str]:
    """Groups whose ``capacity=`` is below their expected ids per destination (every
    step would take extra exchange rounds); with ``warn``, also those below the
    statistics-sized capacity (some steps would)."""
    out = []
    for g in placed.groups:
        given = cost.given(g.name)
        if given is None:
            continue
        sized = fast_path_capacity(g.expected_ids, g.natural_ids, cost.capacity_factor)
        where = f"{g.key[0]}: {g.name}" if g.key[0] else g.name
        numbers = (
            f"width group {where} expects {g.expected_ids:.0f} ids per destination, "
            f"capacity={given} gives {g.capacity}, sized from the statistics: {sized}"
        )
        if g.capacity < g.expected_ids:
            out.append(numbers if not warn else f"{numbers} (below the mean: plan() refuses it)")
        elif warn and g.capacity < sized:
            out.append(f"{numbers} (steps with more ids take extra exchange rounds)")
    return out


def _full_size(t: TableInfo, cost: CostModel) -> float:
    return t.rows * (t.dim * t.itemsize + cost.state_per_row(t, t.dim))


def infeasible_message(
    tables: Sequence[TableInfo],
    options: Sequence[Sequence[ShardingOption]],
    closest: Placement | None,
    cost: CostModel,
    usable: float,
    constraints: Mapping,
    cached: bool = False,
    host_fits: float | None = None,
    reserved_ddr: float = 0.0,
) -> str:
    """Which tables do not fit, how big they are, the closest plan, and what would fit.

    ``cached``: the search also tried host-memory caching; ``host_fits``: the least
    host memory per device of the plans that fit the devices (``None``: none did).
    """
    topo = cost.topology
    lo = topo.ranks_per_host
    lines = [f"no sharding plan fits {topo.world_size} device(s) with {fb(usable)} usable HBM each"]
    if cached:
        host = topo.ddr_cap * (1 - reserved_ddr)
        lines[0] += (
            f", even with tables cached in host memory (fused_uvm_caching; {fb(host)} usable per "
            f"host of ddr_cap {fb(topo.ddr_cap)}, {topo.num_hosts} host(s))"
        )
    smallest = {
        t.key: min(o, key=lambda x: x.per_device_bytes)
        for t, o in zip(tables, options, strict=True)
    }
    alone = [t for t in tables if smallest[t.key].per_device_bytes > usable]
    over = set(closest.overflow) if closest else set()
    bad = alone or [t for t in tables if t.key in over]
    bad = sorted(bad, key=lambda t: (-_full_size(t, cost), t.key))
    lines.append("tables that do not fit:" if alone else "tables the best plan could not place:")
    for t in bad[:SHOWN]:
        s = smallest[t.key]
        allowed = sorted({o.sharding_type.value for o in options[tables.index(t)]})
        lines.append(
            f"  {t.key}: {t.rows} x {t.dim} {t.config.data_type.value}, table + optimizer state "
            f"{fb(_full_size(t, cost))}; smallest per-device footprint {fb(s.per_device_bytes)} "
            f"as {s.label} (allowed: {allowed})"
        )
    if len(bad) > SHOWN:
        lines.append(f"  ... and {len(bad) - SHOWN} smaller tables")
    total = sum(_full_size(t, cost) for t in tables)
    lines.append(
        f"all {len(tables)} tables with optimizer state: {fb(total)}; the devices hold "
        f"{topo.world_size} x {fb(usable)} = {fb(topo.world_size * usable)}"
        + (f", host memory {topo.num_hosts} x {fb(host)}" if cached else "")
    )
    room = topo.world_size * usable + topo.num_hosts * host if cached else math.inf
    if total > room:
        lines.append(f"  together {fb(room)}: less than the tables, whatever the cache load factor")
    if closest is not None:
        mem = closest.memory
        lines.append(
            f"best capacity found: the closest plan needs {fb(closest.hbm)} per device (tables "
            f"{fb(mem[0])}, optimizer state {fb(mem[1])}, buffers {fb(mem[2])}) against "
            f"{fb(usable)} usable"
        )
        if closest.ddr:
            lines.append(
                f"  and {fb(closest.ddr * lo)} of host memory per host (cached tables' rows, "
                f"optimizer state and cache metadata) against {fb(closest.usable_ddr * lo)} usable"
            )
    need = closest.hbm if closest else max(s.per_device_bytes for s in smallest.values())
    lines.append("suggestions:")
    split = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE, ShardingType.GRID_SHARD)
    no_rw = [
        t.key for t in bad if not any(o.sharding_type in split for o in options[tables.index(t)])
    ]
    devices = math.ceil(topo.world_size * need / usable)
    if alone and len(no_rw) == len(alone):
        lines.append(
            f"  - more devices alone will not help: {no_rw} cannot be split by rows under "
            "their constraints"
        )
    elif cached and closest is not None and closest.fullness() > 1:
        hosts = math.ceil(topo.num_hosts * closest.fullness())
        lines.append(
            f"  - more hosts: about {hosts} of {lo} device(s) each (device and host memory "
            "grow with them)"
        )
    elif devices > topo.world_size:
        lines.append(
            f"  - more devices: about {devices} (sharded tables shrink with the device count; "
            "buffers do not)"
        )
    if no_rw:
        lines.append(
            f"  - allow row_wise (or table_row_wise) sharding for {no_rw}: their constraints "
            "exclude every row split"
        )
    lean = optim.rowwise_adagrad(0.01)
    state_now = sum(t.rows * cost.state_per_row(t, t.dim) for t in bad)
    state_lean = sum(
        t.rows * cost.state_per_row(dataclasses.replace(t, optimizer=lean), t.dim) for t in bad
    )
    if state_now > state_lean:
        lines.append(
            f"  - a smaller optimizer state: these tables' state is {fb(state_now)}; with row-wise "
            f"Adagrad it would be {fb(state_lean)}, with SGD 0"
        )
    if closest is not None and closest.memory[2] > 0.25 * closest.hbm:
        lines.append(
            "  - smaller id buffers: lower batch_size or pooling_factors (buffers are "
            f"{fb(closest.memory[2])} per device)"
        )
    if cached and host_fits is not None:
        need = host_fits * lo
        lines.append(
            f"  - more host memory: the plans that fit the devices need at least {fb(need)} per "
            f"host (ddr_cap >= {fb(need / (1 - reserved_ddr))} with reserved_ddr_fraction="
            f"{reserved_ddr:g})"
        )
    if cached and closest is not None and closest.cached and closest.hbm > usable:
        lines.append(
            "  - a smaller cache: ParameterConstraints(cache_params=CacheParams(load_factor=...))"
            " for the largest cached tables"
        )
    no_cache = [t.key for t in bad if not t.constraints.allows_caching]
    if no_cache and not cached:
        lines.append(
            f"  - allow host memory for {no_cache[:SHOWN]}: drop hbm_only / add "
            "'fused_uvm_caching' to compute_kernels (the table in host memory, a device cache)"
        )
    lines.append("  - more HBM per device or a smaller reserved_hbm_fraction")
    return "\n".join(lines)
