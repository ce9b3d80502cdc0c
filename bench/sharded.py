"""Sharded train-step benchmark: step time and collective bytes per sharding type.

Runs on 8 fake CPU devices (``--xla_force_host_platform_device_count=8`` is set
before JAX starts). For each sharding type, every table of an EBC-only model
(``T`` tables ``"t<i>"`` of ``E x D`` reading ``"f<i>"``, ``L`` ids per bag,
``B`` samples per device) is sharded the same way; the model is wrapped by
``DistributedModelParallel`` and trained with ``make_train_step`` (loss
``sum(pooled * R)`` for a fixed random ``R``, row-wise Adagrad) on batches from
``shard_batch``. Plans (ranks are flat mesh indices; 2x4 means 2 "hosts" of 4):

* ``table_wise``: table ``t`` on rank ``t % 8`` (mesh 8)
* ``row_wise``: rows of every table over all 8 ranks (mesh 8)
* ``column_wise``: 2 column blocks per table, on ranks ``2t % 8, 2t+1 % 8`` (mesh 8)
* ``data_parallel``: every table replicated (mesh 8)
* ``table_row_wise``: table ``t`` on host ``t % 2``, rows over its 4 ranks (2x4)
* ``table_column_wise``: table ``t`` on host ``t % 2``, 4 column blocks (2x4)
* ``grid_shard``: one column block per host, rows over each host's 4 ranks (2x4)

Per type it prints one JSON line: step time (median/min/max over ``--reps``),
and the bytes each device hands to collectives per step, both predicted from
the sharded module's layout (``comm_plan``) and summed from the operands of
the collectives in the compiled program's HLO (``comm_hlo``), per kind, with
their ratio ``hlo_over_plan``. "Wire" bytes are what a device sends to other
devices under the usual ring/pairwise algorithms (all-to-all and
reduce-scatter ``(n-1)/n`` of the operand, all-gather ``n-1`` times it,
all-reduce ``2(n-1)/n``). Where TorchRec's scheme for the type is known, the
same two numbers are computed for it (``torchrec_bytes``; ids counted at
4 bytes, as jaxrec's, plus TorchRec's lengths) and ``jaxrec_over_torchrec_wire``.
A last ``unsharded`` line times the same step on one device and the global batch.

``--gpu`` times nothing: per type it compiles the same step twice, for the 8
fake CPU devices (concrete, as above) and deviceless for 8 H100s (topology
``1x1x8``, or ``1x2x4`` for the host-based types; abstract state, nothing
allocated; see ``deviceless_step.py``), and records both programs'
collectives (``comm_hlo_cpu``, ``comm_hlo_gpu``: XLA's GPU collectives are the
asynchronous ``*-start`` ops, counted under their base name) beside the GPU
program's per-device memory and the planner's estimate of it (``gpu_memory``).

Run from the repository root with jaxrec installed (``pip install -e .``)::

    python bench/sharded.py                        # T=8 E=100000 D=64 B=512 L=10
    python bench/sharded.py --E 1000 --B 16 --reps 2 --types table_wise,row_wise
    JAX_PLATFORMS=cpu python bench/sharded.py --gpu --out bench/results/x.jsonl
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import build_jaxrec, cpu_model, jaxrec_kjt, record, time_ms  # noqa: E402
from flax import nnx  # noqa: E402
from specs import LookupSpec, make_inputs  # noqa: E402

from jaxrec import distributed as d  # noqa: E402
from jaxrec import optim, train  # noqa: E402
from jaxrec.embedding import CombinedOptimizer  # noqa: E402
from jaxrec.xla.bounds import BoundsCheckMode  # noqa: E402

BENCH = "sharded_train_step"
WORLD, HOSTS = 8, 2
LOCAL = WORLD // HOSTS
TYPES = (
    "table_wise",
    "row_wise",
    "column_wise",
    "data_parallel",
    "table_row_wise",
    "table_column_wise",
    "grid_shard",
)
F32 = I32 = 4


def generators(kind: str, T: int) -> tuple[dict, int]:
    """``({table: plan builder}, hosts)`` for one sharding type."""
    gen = {
        "table_wise": lambda t: d.table_wise(t % WORLD),
        "row_wise": lambda t: d.row_wise(),
        "column_wise": lambda t: d.column_wise([2 * t % WORLD, (2 * t + 1) % WORLD]),
        "data_parallel": lambda t: d.data_parallel(),
        "table_row_wise": lambda t: d.table_row_wise(t % HOSTS),
        "table_column_wise": lambda t: d.table_column_wise(t % HOSTS),
        "grid_shard": lambda t: d.grid_shard(list(range(HOSTS))),
    }[kind]
    hosts = HOSTS if kind in ("table_row_wise", "table_column_wise", "grid_shard") else 1
    return {f"t{t}": gen(t) for t in range(T)}, hosts


class Model(nnx.Module):
    def __init__(self, ebc):
        self.ebc = ebc


def loss_fn(model, batch):
    kjt, r = batch
    return jnp.sum(model.ebc(kjt).values() * r)


def optimizer():
    return CombinedOptimizer(optax.sgd(0.0), optim.rowwise_adagrad(0.1))


QCOMMS: dict = {"precision": "fp32"}  # set by --qcomms


def shard(model, plan, mesh, spec: LookupSpec):
    """``DistributedModelParallel`` with the benchmark's input statistics and QComms."""
    p = QCOMMS["precision"]
    return d.DistributedModelParallel(
        model,
        plan,
        mesh,
        pooling_factors={f"f{t}": float(spec.L) for t in range(spec.T)},
        qcomms=d.QCommsConfig(forward_precision=p, backward_precision=p),
    )


def local_batches(spec: LookupSpec, seed: int) -> list:
    """One ``(kjt, R)`` per device: ``B`` samples, every key's capacity ``B * L``."""
    out = []
    for dev in range(WORLD):
        kjt = jaxrec_kjt(spec, make_inputs(spec, seed + dev))
        r = np.random.default_rng(1000 + seed + dev).normal(size=(spec.B, spec.T * spec.D))
        out.append((kjt, r.astype(np.float32)))
    return out


# ----- bytes: from the layout -----
def wire_factor(kind: str, n: int) -> float:
    return {
        "all-to-all": (n - 1) / n,
        "reduce-scatter": (n - 1) / n,
        "all-gather": n - 1,
        "all-reduce": 2 * (n - 1) / n,
        "collective-permute": 1.0,  # each device sends its operand to one peer
    }[kind]


def plan_bytes(ebc, kjt, spec: LookupSpec) -> dict[str, dict[str, int]]:
    """Per-device operand bytes of each collective of one train step's fast path, from the
    layout (ids beyond the fast path take extra rounds inside loops, counted apart).

    Per width group: the input_dist all_to_all of one int32 ``[world, P]`` payload (``C``
    rows, then the bags: ``S * B`` counts or ``C`` segments, whichever is smaller, then
    ``C`` weights if weighted; ``exchange.Spec.width``), the output_dist all_to_all of the
    partial blocks ``[world, slots, B, ncols]`` and, backward, the all_to_all of gradient
    blocks of the same shape (in the qcomms precisions). ``apply_sparse_gradients`` runs
    input_dist again, with the same inputs: XLA's CSE merges it with the forward's, so
    ids move once. Data-parallel groups all_gather their row gradients (int32 rows,
    float32 grads, bool mask per local id). The loss (a sum over the sharded batch) adds
    one float32 all-reduce; ``overflow="exact"`` one int32 max per group (the rounds every
    device runs); each bounds check (WARNING or FATAL: ids per feature of a sharded table,
    ids and layouts per replicated group) one int32 count and one example each, reduced
    together. Row-wise Adagrad completes each row's sum across column shards: groups
    holding column-split tables send their peers one float32 per unique row received
    (``collective-permute`` rounds of ``row_sums.peer_schedule``).
    """
    from jaxrec.distributed.row_sums import peer_schedule

    n, b = WORLD, spec.B
    fwd_bytes = jnp.dtype(ebc.qcomms.forward_dtype).itemsize
    bwd_bytes = jnp.dtype(ebc.qcomms.backward_dtype).itemsize
    out = {
        "ids_all_to_all": 0,
        "fwd_output_all_to_all": 0,
        "bwd_grad_all_to_all": 0,
        "dp_row_grad_all_gather": 0,
        "loss_all_reduce": F32,
        "rounds_all_reduce": I32 * len(ebc.layout.groups) if ebc.exact else 0,
        "overflow_all_reduce": I32 if ebc.overflow_mode != "count" else 0,
        "row_sum_permute": 0,
        "bounds_report_all_reduce": 0,
    }
    if BoundsCheckMode(ebc.bounds_check_mode) in (BoundsCheckMode.WARNING, BoundsCheckMode.FATAL):
        # each check's count summed, a bad id max-reduced: one id check per feature
        # of a sharded table; a replicated group's lookup checks its ids and bag
        # layouts (and weights) once for the group
        checked = sum(
            t.num_features() for t in ebc.table_configs if t.name not in ebc.layout.replicated
        )
        checked += len(ebc.replicated_groups) * (3 if ebc._weighted() else 2)
        out["bounds_report_all_reduce"] = checked * (I32 + kjt.values().dtype.itemsize)
    caps = dict(zip(kjt.keys(), kjt.capacity_per_key(), strict=True))
    for g, xspec, _ in ebc._exchanges(kjt):
        blocks = n * g.max_slots * b * g.ncols
        out["ids_all_to_all"] += n * xspec.width(first=True) * I32
        out["fwd_output_all_to_all"] += blocks * fwd_bytes
        out["bwd_grad_all_to_all"] += blocks * bwd_bytes
        k = max(n * xspec.capacity, max(len(r) for r in g.shards) + 1)
        sizes = {
            t.name: min(k, n * sum(caps[f] for f in t.feature_names)) for t in ebc.table_configs
        }
        sched = peer_schedule(g, ebc.layout, ebc.table_configs, sizes)
        if sched is not None:
            out["row_sum_permute"] += sum(F32 * send.shape[1] for _, send, _ in sched.rounds)
    for rg in ebc.replicated_groups:
        ids = sum(caps[s.key] for s in rg.slots)
        out["dp_row_grad_all_gather"] += ids * (I32 + rg.embedding_dim * F32 + 1)
    kinds = {
        "all-to-all": sum(v for k, v in out.items() if k.endswith("all_to_all")),
        "all-gather": out["dp_row_grad_all_gather"],
        "all-reduce": sum(v for k, v in out.items() if k.endswith("all_reduce")),
        "collective-permute": out["row_sum_permute"],
    }
    return {"stages": out, "kinds": {k: v for k, v in kinds.items() if v}}


# ----- bytes: from the compiled program -----
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
COLLECTIVE = re.compile(
    r"=\s*(?P<result>.*?)\s(?P<op>all-to-all|all-gather|all-reduce|reduce-scatter|"
    r"collective-permute)(?P<start>-start)?\((?P<args>[^)]*)\)(?P<attrs>.*)$"
)
SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def _nbytes(text: str) -> int:
    total = 0
    for dtype, dims in SHAPE.findall(text):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * int(np.prod([int(x) for x in dims.split(",") if x]))
    return total


def _group_size(attrs: str, default: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)  # iota form [groups,size]<=[...]
    if m:
        return int(m.group(2))
    # XLA:GPU's mesh form: mesh['axis_0'=2,'axis_1'=4] {'axis_1'} (the reduced axes in braces)
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return int(np.prod([int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2))]))
    return default


def _start_operands(op: str, result: str) -> str | None:
    """The operands of an async ``*-start`` whose result is ``(operands, results)``.

    XLA:GPU prints them without shapes; the result's first element holds them
    (a tuple when there are several, or one operand wrapped alone). An
    ``all-reduce-start``'s result is its output only (the operands' size).
    """
    if op == "all-reduce" or not result.startswith("("):
        return None
    depth = 0
    for i, ch in enumerate(result[1:], start=1):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if depth == 0 and ch in ",)":
            return result[1:i]
    return None


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """``{computation name: its lines}`` of an HLO module's text."""
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            head = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            name = head.lstrip("%")
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    return comps


def _in_loops(comps: dict[str, list[str]]) -> set[str]:
    """Computations that run inside a ``while`` (bodies, conditions and what they call):
    the sharded step's overflow path, which runs only when ids exceed the fast path."""
    ref = re.compile(r"%([\w.\-]+)")
    todo = [
        m
        for lines in comps.values()
        for line in lines
        if " while(" in line
        for m in re.findall(r"(?:body|condition)=%([\w.\-]+)", line)
    ]
    seen: set[str] = set()
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        todo += [m for line in comps[c] for m in ref.findall(line) if m in comps]
    return seen


def hlo_collectives(hlo_text: str) -> list[dict]:
    """Every collective op of an HLO module: kind, operand bytes, group size, and whether
    it runs inside a loop (``in_loop``: the overflow path)."""
    comps = _computations(hlo_text) or {"": hlo_text.splitlines()}
    loops = _in_loops(comps)
    ops = []
    for comp, lines in comps.items():
        for line in lines:
            m = COLLECTIVE.search(line)
            if not m:
                continue
            operand = _nbytes(m.group("args"))
            start = m.group("start")
            operands = _start_operands(m.group("op"), m.group("result")) if start else None
            if operand == 0 and operands is not None:  # XLA:GPU's async ops: ((ops), results)
                operand = _nbytes(operands)
            elif operand == 0:  # operands printed without shapes: derive from the result
                result = _nbytes(m.group("result"))
                n = _group_size(m.group("attrs"), WORLD)
                operand = result // n if m.group("op") == "all-gather" else result
            op = {
                "op": m.group("op"),
                "bytes": operand,
                "group": _group_size(m.group("attrs"), WORLD),
            }
            if comp in loops:
                op["in_loop"] = True
            ops.append(op)
    return ops


def summarize(ops: list[dict]) -> dict:
    """Bytes per kind and wire bytes of the fast path (ops outside loops); the overflow
    path's collectives (one extra round or update pass each) are summed apart."""
    kinds: dict[str, int] = {}
    loop: dict[str, int] = {}
    for o in ops:
        into = loop if o.get("in_loop") else kinds
        into[o["op"]] = into.get(o["op"], 0) + o["bytes"]
    fast = [o for o in ops if not o.get("in_loop") and o["group"] > 1]
    wire = sum(o["bytes"] * wire_factor(o["op"], o["group"]) for o in fast)
    out = {"kinds": kinds, "count": len(ops) - sum(1 for o in ops if o.get("in_loop"))}
    out["wire"] = int(wire)
    if loop:
        out["overflow_path_kinds"] = loop
    return out


# ----- bytes: TorchRec's schemes -----
def torchrec_bytes(kind: str, spec: LookupSpec) -> dict | None:
    """Per-device (average) operand and wire bytes of TorchRec's collectives for one step.

    Ids and lengths move with variable-size all_to_alls (no padding), ids at
    4 bytes. Pooled outputs: all_to_all for TW/CW (and the gradients back),
    reduce-scatter of ``[B_global, D]`` partial sums for RW (all-gather of the
    gradients back); TWRW/grid reduce-scatter within a host, then all_to_all
    across hosts (and back); data parallel all-reduces dense table gradients
    (DDP).
    """
    T, E, D, B, L, n = spec.T, spec.E, spec.D, spec.B, spec.L, WORLD
    ids = T * B * (L + 1) * I32  # values + one length per bag, this device's batch
    pooled = T * B * D * {"fp32": 4, "fp16": 2, "bf16": 2}[QCOMMS["precision"]]  # QComms
    parts: list[tuple[str, str, float, int]] = []  # (stage, kind, bytes, group)
    if kind in ("table_wise", "column_wise", "table_column_wise"):
        copies = {"table_wise": 1, "column_wise": 2, "table_column_wise": LOCAL}[kind]
        parts += [
            ("ids", "all-to-all", copies * ids, n),
            ("fwd_output", "all-to-all", pooled, n),
            ("bwd_grad", "all-to-all", pooled, n),
        ]
    elif kind == "row_wise":
        parts += [
            ("ids", "all-to-all", T * B * (L + n) * I32, n),  # lengths per bucket
            ("fwd_output", "reduce-scatter", n * pooled, n),
            ("bwd_grad", "all-gather", pooled, n),
        ]
    elif kind in ("table_row_wise", "grid_shard"):
        copies = HOSTS if kind == "grid_shard" else 1  # one column block per host
        per_host = n * pooled // HOSTS  # a host's columns, for the global batch
        parts += [
            ("ids", "all-to-all", copies * T * B * (L + LOCAL) * I32, n),
            ("fwd_intra_host", "reduce-scatter", per_host, LOCAL),
            ("fwd_cross_host", "all-to-all", per_host // LOCAL, HOSTS),
            ("bwd_cross_host", "all-to-all", per_host // LOCAL, HOSTS),
            ("bwd_intra_host", "all-gather", per_host // LOCAL, LOCAL),
        ]
    elif kind == "data_parallel":
        parts += [("table_grad", "all-reduce", T * E * D * F32, n)]
    else:
        return None
    return {
        "stages": {s: int(b) for s, _, b, _ in parts},
        "operand": int(sum(b for _, _, b, _ in parts)),
        "wire": int(sum(b * wire_factor(k, g) for _, k, b, g in parts)),
    }


# ----- the benchmark -----
def mesh_for(hosts: int) -> jax.sharding.Mesh:
    auto = jax.sharding.AxisType.Auto
    if hosts == 1:
        return jax.make_mesh((WORLD,), ("x",), axis_types=(auto,))
    return jax.make_mesh((HOSTS, LOCAL), ("host", "local"), axis_types=(auto, auto))


def timed_steps(step, state, batch, reps: int, warmup: int) -> tuple[list[float], float]:
    """Step times in ms (state donated and carried over) and the first step's loss."""
    box, first_loss = [state], []
    del state

    def one():
        box[0], loss, _ = step(box[0], batch)
        jax.block_until_ready((box[0], loss))
        if not first_loss:
            first_loss.append(float(loss))

    return time_ms(one, reps, warmup), first_loss[0]


def run_type(kind: str, spec: LookupSpec, reps: int, warmup: int, seed: int) -> dict:
    gens, hosts = generators(kind, spec.T)
    mesh = mesh_for(hosts)
    model = Model(build_jaxrec(spec, seed=seed))
    plan = d.construct_module_sharding_plan(
        model.ebc, gens, world_size=WORLD, local_size=WORLD // hosts
    )
    model = shard(model, d.ShardingPlan({"ebc": plan}), mesh, spec)
    locals_ = local_batches(spec, seed)
    batch = d.shard_batch(locals_, mesh)
    predicted = plan_bytes(model.ebc, locals_[0][0], spec)
    opt = optimizer()
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    compiled = step.lower(state, batch).compile()
    ops = hlo_collectives(compiled.as_text())
    hlo = summarize(ops)
    del model
    times, first_loss = timed_steps(step, state, batch, reps, warmup)
    plan_total = sum(predicted["kinds"].values())
    hlo_total = sum(hlo["kinds"].values())
    plan_wire = sum(b * wire_factor(k, WORLD) for k, b in predicted["kinds"].items())
    extra = {
        "sharding_type": kind,
        "world": WORLD,
        "mesh": "x".join(map(str, mesh.devices.shape)),
        "B_global": WORLD * spec.B,
        "optimizer": "EXACT_ROWWISE_ADAGRAD",
        "qcomms": QCOMMS["precision"],
        "first_loss": first_loss,
        "comm_plan": predicted,
        "comm_hlo": hlo,
        "bytes_plan": plan_total,
        "bytes_hlo": hlo_total,
        "hlo_over_plan": round(hlo_total / plan_total, 4) if plan_total else None,
        "wire_plan": int(plan_wire),
        "wire_hlo": hlo["wire"],
        "bytes_meaning": "per device per step: summed operand sizes of its collectives",
    }
    tr = torchrec_bytes(kind, spec)
    if tr is not None:
        extra["torchrec_bytes"] = tr
        extra["jaxrec_over_torchrec_operand"] = round(hlo_total / tr["operand"], 3)
        extra["jaxrec_over_torchrec_wire"] = round(hlo["wire"] / tr["wire"], 3)
    rec = record(BENCH, spec, kind, times, **extra)
    del state, batch, step, compiled
    gc.collect()
    return rec


def run_unsharded(spec: LookupSpec, reps: int, warmup: int, seed: int) -> dict:
    """The same step on one device and the concatenated global batch."""
    model = Model(build_jaxrec(spec, seed=seed))
    locals_ = local_batches(spec, seed)
    glob = LookupSpec(**{**spec.as_dict(), "B": WORLD * spec.B})
    inputs = [make_inputs(spec, seed + dev) for dev in range(WORLD)]
    merged = {
        "keys": inputs[0]["keys"],
        "values": np.concatenate(
            [
                np.concatenate([x["values"].reshape(spec.T, -1)[t] for x in inputs])
                for t in range(spec.T)
            ]
        ),
        "lengths": np.full(glob.T * glob.B, spec.L, np.int32),
        "weights": None,
    }
    batch = (jaxrec_kjt(glob, merged), jnp.asarray(np.concatenate([r for _, r in locals_])))
    opt = optimizer()
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    del model
    times, first_loss = timed_steps(step, state, batch, reps, warmup)
    extra = {
        "sharding_type": None,
        "world": 1,
        "B_global": glob.B,
        "optimizer": "EXACT_ROWWISE_ADAGRAD",
        "first_loss": first_loss,
    }
    return record(BENCH, spec, "unsharded", times, **extra)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("T", 8), ("E", 100_000), ("D", 64), ("B", 512), ("L", 10)):
        help_ = "samples per device" if name == "B" else None
        p.add_argument(f"--{name}", type=int, default=default, help=help_)
    p.add_argument("--types", default=",".join(TYPES), help=f"comma-separated, from {TYPES}")
    p.add_argument("--no-unsharded", action="store_true", help="skip the one-device line")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed steps (the first compiles)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gpu",
        action="store_true",
        help="compile for 8 H100s deviceless (no timing): collectives and memory",
    )
    p.add_argument("--implementation", default=None, help="--gpu: xla, pallas (default: None)")
    p.add_argument("--bounds-check", default=None, help="--gpu: a BoundsCheckMode name")
    p.add_argument(
        "--qcomms",
        default="fp32",
        choices=("fp32", "fp16", "bf16"),
        help="precision of pooled blocks and their gradients (TorchRec's QComms)",
    )
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    return p.parse_args(argv)


# ----- deviceless GPU compile: collectives and memory of the 8-GPU program -----
GPU_TARGET = "deviceless compile for H100 (sm_90a), no GPU run"


def gpu_compile_type(
    kind: str, spec: LookupSpec, seed: int, implementation: str | None, bounds_check: str | None
) -> dict:
    """Collectives and per-device memory of the step compiled for 8 H100s, plus the
    planner's estimate; the same model, plan and per-device batch as ``run_type``."""
    import deviceless_step as ds

    from jaxrec import BoundsCheckMode

    gens, hosts = generators(kind, spec.T)
    mesh = ds.gpu_mesh("1x1x8" if hosts == 1 else f"1x{HOSTS}x{LOCAL}")
    kw = {} if bounds_check is None else {"bounds_check_mode": BoundsCheckMode[bounds_check]}
    tables = build_jaxrec(spec, seed=seed).table_configs  # small enough to build once
    ebc = nnx.eval_shape(
        lambda: jr_ebc(tables, rngs=nnx.Rngs(seed), implementation=implementation, **kw)
    )
    module = d.construct_module_sharding_plan(
        ebc, gens, world_size=WORLD, local_size=WORLD // hosts
    )
    plan = d.ShardingPlan({"ebc": module})

    def build():
        ebc = jr_ebc(tables, rngs=nnx.Rngs(seed), implementation=implementation, **kw)
        return shard(Model(ebc), plan, mesh, spec)

    kjt, r = local_batches(spec, seed)[0]
    opt = optimizer()
    compiled, state = ds.compile_train_step(
        build, opt, loss_fn, (kjt, r), mesh, implementation=implementation
    )
    estimate = ds.planner_estimate(
        plan,
        {"ebc": list(tables)},
        world_size=WORLD,
        local_world_size=WORLD // hosts,
        batch_size=spec.B,
        capacities={t.name: [spec.B * spec.L] for t in tables},
        optimizer=opt,
    )
    return {
        "mesh": "x".join(map(str, mesh.devices.shape)),
        "comm_hlo_gpu": summarize(hlo_collectives(compiled.as_text())),
        "gpu_memory": ds.memory_report(compiled, state, estimate),
    }


def jr_ebc(tables, **kwargs):
    from jaxrec import EmbeddingBagCollection

    return EmbeddingBagCollection(list(tables), **kwargs)


def cpu_collectives(kind: str, spec: LookupSpec, seed: int) -> tuple[dict, dict]:
    """``(comm_plan, comm_hlo)`` of the step compiled for the 8 CPU devices (not run)."""
    gens, hosts = generators(kind, spec.T)
    model = Model(build_jaxrec(spec, seed=seed))
    plan = d.construct_module_sharding_plan(
        model.ebc, gens, world_size=WORLD, local_size=WORLD // hosts
    )
    model = shard(model, d.ShardingPlan({"ebc": plan}), mesh_for(hosts), spec)
    locals_ = local_batches(spec, seed)
    batch = d.shard_batch(locals_, model.ebc.mesh)
    opt = optimizer()
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    ops = hlo_collectives(step.lower(state, batch).compile().as_text())
    return plan_bytes(model.ebc, locals_[0][0], spec), summarize(ops)


def run_gpu(kind, spec, seed, implementation, bounds_check) -> dict:
    predicted, cpu = cpu_collectives(kind, spec, seed)
    gpu = gpu_compile_type(kind, spec, seed, implementation, bounds_check)
    gpu_kinds = {}
    for k, v in gpu["comm_hlo_gpu"]["kinds"].items():
        gpu_kinds[k] = gpu_kinds.get(k, 0) + v
    return {
        "bench": BENCH + "_gpu_compile",
        "impl": kind,
        **spec.as_dict(),
        "target": GPU_TARGET,
        "machine": f"compiled on {cpu_model()} (no GPU)",
        "jax_version": jax.__version__,
        "sharding_type": kind,
        "world": WORLD,
        "mesh": gpu["mesh"],
        "B_global": WORLD * spec.B,
        "optimizer": "EXACT_ROWWISE_ADAGRAD",
        "qcomms": QCOMMS["precision"],
        "implementation": implementation,
        "bounds_check": bounds_check or "default",
        "comm_plan": predicted,
        "comm_hlo_cpu": cpu,
        "comm_hlo_gpu": gpu["comm_hlo_gpu"],
        "gpu_over_cpu_bytes": round(
            sum(gpu["comm_hlo_gpu"]["kinds"].values()) / max(1, sum(cpu["kinds"].values())), 4
        ),
        "gpu_memory": gpu["gpu_memory"],
        "bytes_meaning": "per device per step: summed operand sizes of its collectives",
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    QCOMMS["precision"] = args.qcomms
    spec = LookupSpec(T=args.T, E=args.E, D=args.D, B=args.B, L=args.L)
    kinds = args.types.split(",")
    bad = sorted(set(kinds) - set(TYPES))
    if bad:
        raise SystemExit(f"unknown types {bad}; choose from {TYPES}")
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 (closed below)
    for kind in kinds:
        if args.gpu:
            rec = run_gpu(kind, spec, args.seed, args.implementation, args.bounds_check)
        else:
            rec = run_type(kind, spec, args.reps, args.warmup, args.seed)
        print(json.dumps(rec), flush=True)
        if out:
            out.write(json.dumps(rec) + "\n")
            out.flush()  # a long --gpu run keeps what it has measured
    if out:
        out.close()
    if not args.no_unsharded and not args.gpu:
        print(json.dumps(run_unsharded(spec, args.reps, args.warmup, args.seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
