"""Production-size planning: does a 500-table model fit, with how much padding, moving what.

Generates a seeded production-like table set (issue 22) and plans it with the
default planner settings, without building any arrays: ``T`` tables (500),
five of 1e9 rows and the rest log-uniform in [100, 2e8] rows, dims from
{16, 32, 64, 128, 256}, 30% FP16, one feature per table with a pooling
factor log-uniform in [1, 80], row-wise Adagrad. Every table's rows are then
scaled by one factor so that tables + optimizer state are ``--fractions`` of
the topology's aggregate device memory. Devices hold ``--hbm-gb`` GB each
(80 GB = 80 * 10**9 bytes, a little less than an H100's 80 GiB-class
memory), with ``--batch`` samples per device (1,024).

One JSON line per (topology, fraction): whether a plan fits; per device the
padded memory jaxrec allocates (every device runs the fullest rank's shapes)
vs the mean unpadded memory of the ranks' own shards, and their ratio;
tables, optimizer state and buffers (the id buffers, sized by the planner's
statistics, apart); the collective operand and wire bytes per device per step
of jaxrec's exchange (the planner's estimate, per stage) and of TorchRec's
scheme for the same plan (``torchrec_comm.py``: ids as values + lengths,
pooled outputs by all_to_all, reduce-scatter or host-local reduce-scatter +
cross-host all_to_all, DDP all-reduce for data-parallel tables) and their
ratio; the same for ``exchange="ragged"`` (GPUs: ``ragged_all_to_all`` sends
each payload's real ids and each shard's own blocks, not the padding up to the
fullest rank; ``ragged_comm``); the sharding types chosen; planning time; the
CPU and the date.

    python bench/scale.py                                  # 64x8 and 8x8 at 13, 25, 50%
    python bench/scale.py --topologies 64x8 --fractions 0.5 --out results.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import time

import numpy as np
import torchrec_comm
from common import cpu_model, emit

import jaxrec
from jaxrec import DataType, EmbeddingBagConfig
from jaxrec.distributed.layout import build_layout
from jaxrec.distributed.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    PlannerError,
    Topology,
)

DIMS = (16, 32, 64, 128, 256)
GB = 10**9
GiB = 2**30
STATE_BYTES_PER_ROW = 4  # row-wise Adagrad: one float32 per row
# jaxrec's stages (planner PlanStats.comm_bytes) -> collective kind, for wire bytes
JAXREC_KINDS = {
    "ids_all_to_all": "all-to-all",
    "fwd_output_all_to_all": "all-to-all",
    "bwd_grad_all_to_all": "all-to-all",
    "dp_row_grad_all_gather": "all-gather",
    "row_sum_exchange": "ppermute",
}


def table_set(
    fraction: float,
    topology: Topology,
    *,
    num_tables: int = 500,
    big_tables: int = 5,
    seed: int = 0,
) -> tuple[list[EmbeddingBagConfig], dict[str, ParameterConstraints], float]:
    """``(tables, constraints, row scale)`` of the production-like set (module docstring)."""
    rng = np.random.default_rng(seed)
    rows = np.exp(rng.uniform(math.log(100), math.log(2e8), num_tables))
    rows[:big_tables] = 1e9
    dims = rng.choice(DIMS, num_tables)
    fp16 = rng.random(num_tables) < 0.3
    pooling = np.exp(rng.uniform(0.0, math.log(80), num_tables))
    per_row = dims * np.where(fp16, 2, 4) + STATE_BYTES_PER_ROW
    scale = fraction * topology.world_size * topology.hbm_cap / float((rows * per_row).sum())
    scaled = np.maximum(1, np.round(rows * scale)).astype(np.int64)
    tables, constraints = [], {}
    for i in range(num_tables):
        name = f"t{i}"
        tables.append(
            EmbeddingBagConfig(
                name=name,
                num_embeddings=int(scaled[i]),
                embedding_dim=int(dims[i]),
                data_type=DataType.FP16 if fp16[i] else DataType.FP32,
                feature_names=[f"f{i}"],
            )
        )
        constraints[name] = ParameterConstraints(pooling_factors=[round(float(pooling[i]), 2)])
    return tables, constraints, scale


def torchrec_inputs(tables, constraints, batch: int) -> dict[str, torchrec_comm.TableInputs]:
    """Each table's mean ids and bags per device, as TorchRec would send them."""
    out = {}
    for t in tables:
        pf = constraints[t.name].pooling_factors or (1.0,)
        ids = sum(batch * p for p in (pf * len(t.feature_names) if len(pf) == 1 else pf))
        item = 4 if t.data_type is DataType.FP32 else 2
        out[t.name] = torchrec_comm.TableInputs(
            rows=t.num_embeddings,
            dim=t.embedding_dim,
            itemsize=item,
            features=len(t.feature_names),
            ids=ids,
            bags=batch * len(t.feature_names),
        )
    return out


def jaxrec_comm(stages: dict[str, int], topology: Topology) -> dict:
    wire = sum(
        b * torchrec_comm.wire_factor(JAXREC_KINDS[k], topology.world_size)
        for k, b in stages.items()
    )
    return {"stages": dict(stages), "operand": int(sum(stages.values())), "wire": int(wire)}


def ragged_comm(tables, constraints, module, capacities, topology: Topology, batch: int) -> dict:
    """Operand and wire bytes per device per step of ``exchange="ragged"`` (GPUs): the
    same plan's id payloads and pooled blocks without their padding. Each source sends
    each destination its expected ids (with the per-(slot, bag) counts, whole, or one
    segment per id, as the collection lays them out) and each shard its own slots'
    blocks, not the fullest rank's count.
    """
    n = topology.world_size
    layout = build_layout(tables, module, n)
    mean_ids = {}
    for t in tables:
        pf = constraints[t.name].pooling_factors or (1.0,)
        pf = pf * len(t.feature_names) if len(pf) == 1 else pf
        mean_ids.update((f, batch * p) for f, p in zip(t.feature_names, pf, strict=True))
    ids = blocks = 0.0
    for g in layout.groups:
        meta = g.max_slots * batch
        by_counts = meta <= capacities[g.name]
        for slots in g.slots:  # to each destination
            load = sum(mean_ids[s.key] * s.nrows / s.table_rows for s in slots)
            ids += 4 * (meta + load if by_counts else 2 * load)
        # forward blocks and backward gradients: each shard's own slots, to N sources
        blocks += 2 * sum(len(s) for s in g.slots) * batch * g.ncols * 4
    stages = {"ids_all_to_all": int(ids), "blocks_all_to_all": int(blocks)}
    wire = sum(stages.values()) * torchrec_comm.wire_factor("all-to-all", n)
    return {"stages": stages, "operand": int(sum(stages.values())), "wire": int(wire)}


def run(
    fraction: float,
    world: int,
    local: int,
    *,
    hbm_gb: float = 80.0,
    batch: int = 1024,
    num_tables: int = 500,
    seed: int = 0,
) -> dict:
    """Plans one configuration; the JSON record (see the module docstring)."""
    topo = Topology(
        world_size=world, local_world_size=local, hbm_cap=int(hbm_gb * GB), batch_size=batch
    )
    tables, constraints, scale = table_set(fraction, topo, num_tables=num_tables, seed=seed)
    planner = EmbeddingShardingPlanner(topo, constraints)
    start = time.perf_counter()
    try:
        plan = planner.plan(tables)
        stats, error = planner.last_stats, None
    except PlannerError as e:
        plan, stats, error = None, e.stats, str(e).splitlines()[0]
    seconds = time.perf_counter() - start
    item = {t.name: 4 if t.data_type is DataType.FP32 else 2 for t in tables}
    full = sum(
        t.num_embeddings * (t.embedding_dim * item[t.name] + STATE_BYTES_PER_ROW) for t in tables
    )
    rec = {
        "bench": "scale",
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "jaxrec_version": getattr(jaxrec, "__version__", "?"),
        "world": world,
        "local": local,
        "hosts": world // local,
        "hbm_bytes": topo.hbm_cap,
        "hbm_note": f"{hbm_gb:g} GB = {hbm_gb:g} * 10**9 bytes per device",
        "batch_per_device": batch,
        "fraction": fraction,
        "tables": num_tables,
        "seed": seed,
        "optimizer": "rowwise_adagrad",
        "tables_and_state_bytes": int(full),
        "row_scale": round(scale, 6),
        "largest_rows": max(t.num_embeddings for t in tables),
        "fp16_tables": sum(t.data_type is DataType.FP16 for t in tables),
        "fits": plan is not None,
        "error": error,
        "planning_s": round(seconds, 3),
    }
    if stats is None:
        return rec
    p = stats.placement
    own = np.asarray(p.own_memory)
    parts = stats.buffer_bytes
    rec.update(
        proposals=stats.proposals,
        best_from=stats.winner or None,
        usable_bytes_per_device=int(p.usable_bytes),
        padded_bytes_per_device=int(p.hbm),
        mean_unpadded_bytes_per_device=int(own.mean()),
        max_unpadded_bytes_per_device=int(own.max()),
        padded_over_mean_unpadded=round(p.hbm / own.mean(), 4),
        padded_gib=round(p.hbm / GiB, 3),
        tables_bytes=int(p.memory[0]),
        state_bytes=int(p.memory[1]),
        buffers_bytes=int(p.memory[2]),
        buffer_parts={k: int(v) for k, v in parts.items()},
        id_buffer_bytes=int(parts["ids"] + parts["received"]),
        groups=[
            {
                "group": g.name,
                "rows_per_rank": g.rows_per_rank,
                "slots": g.slots,
                "expected_ids": round(g.expected_ids, 1),
                "capacity": g.capacity,
                "natural_ids": g.natural_ids,
            }
            for g in sorted(p.groups, key=lambda g: (g.key[2], g.key[1]))
        ],
        step_estimate_ms=round(p.perf.total * 1e3, 3),
        tables_cut_by_rows=len(p.split),
    )
    if plan is None:
        return rec
    module = plan.plan[""]
    kinds: dict[str, int] = {}
    for ps in module.values():
        kinds[ps.sharding_type.value] = kinds.get(ps.sharding_type.value, 0) + 1
    ours = jaxrec_comm(stats.comm_bytes, topo)
    theirs = torchrec_comm.summarize(
        torchrec_comm.plan_parts(
            module,
            torchrec_inputs(tables, constraints, batch),
            world=world,
            local=local,
            batch=batch,
        )
    )
    ragged = ragged_comm(tables, constraints, module, stats.capacities[""], topo, batch)
    rec.update(
        sharding_types=dict(sorted(kinds.items())),
        jaxrec_comm=ours,
        torchrec_comm=theirs,
        jaxrec_over_torchrec_operand=round(ours["operand"] / theirs["operand"], 3),
        jaxrec_over_torchrec_wire=round(ours["wire"] / theirs["wire"], 3),
        jaxrec_ragged_comm=ragged,
        ragged_over_torchrec_wire=round(ragged["wire"] / theirs["wire"], 3),
        bytes_meaning="per device per step: summed operand (or wire) bytes of its collectives",
    )
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topologies", default="64x8,8x8", help="devices x devices per host, ...")
    p.add_argument("--fractions", default="0.13,0.25,0.5", help="of aggregate device memory")
    p.add_argument("--hbm-gb", type=float, default=80.0, help="GB (10**9 bytes) per device")
    p.add_argument("--batch", type=int, default=1024, help="samples per device")
    p.add_argument("--tables", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    for topo in args.topologies.split(","):
        world, local = (int(x) for x in topo.split("x"))
        for fraction in (float(x) for x in args.fractions.split(",")):
            rec = run(
                fraction,
                world,
                local,
                hbm_gb=args.hbm_gb,
                batch=args.batch,
                num_tables=args.tables,
                seed=args.seed,
            )
            emit(rec, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
