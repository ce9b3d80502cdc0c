"""jaxrec vs TorchRec + FBGEMM on the CPU, side by side: EBC forward and fused train steps.

For each configuration, both frameworks get the same tables (jaxrec's initial
weights copied into TorchRec), the same ids and the same thread count
(``torch.set_num_threads(n)`` and ``JAXREC_CPU_THREADS=n``, ``n`` = the cores
this process may use). Repetitions are interleaved (jaxrec, TorchRec, jaxrec,
...) so that noise from other jobs on the machine hits both alike; medians are
reported. Phases:

* ``forward``: ``EmbeddingBagCollection`` forward (jaxrec ``jax.jit`` over the
  split module, ``implementation=--impl``) vs TorchRec's EBC.
* ``train_<optimizer>``: one training step of ``loss = sum(pooled * R)``:
  jaxrec's ``make_train_step`` (donated state, fused sparse update) vs
  TorchRec's ``DistributedModelParallel`` (world size 1, TABLE_WISE, FUSED
  kernel: ``backward()`` applies FBGEMM's fused optimizer). Both run the same
  number of steps from the same weights; touched rows must then agree.

The roofline: in the same run, the machine's own ceilings for this access
pattern (``jaxrec.cpu.read_bandwidth`` / ``gather_rows`` / ``gather_pool_rows``,
small C++ loops): a sequential read of the table (up to 1 GiB), a gather of
the forward's rows (the same ids, rows and row size from jaxrec's table,
summed in registers), and ``gather_pool``, that gather writing the forward's
output too (each bag's sum, in order, into a reused buffer: at L=1 a lookup
writes as much as it reads, which ``gather`` does not count); each with 1
thread and with ``n``. The gathers are timed in the forward's interleaved
turns (after the frameworks, so the protocol's cache state is theirs: they
never warm jaxrec's next call), at the prefetch distance that was fastest for
the plain gather. Every phase is reported as a fraction of the faster of each
(1 or ``n`` threads; small calls may gain nothing from a second thread): the
forward's ``ceiling ms / phase ms``; a train step's traffic is modeled as the
forward's rows plus each unique row read and written back once (and row-wise
Adagrad's one float of state per row).

Prints one JSON line per (configuration, phase, framework), one per ceiling,
and one ``ratio`` line per (configuration, phase): ``torchrec median_ms /
jaxrec median_ms`` (> 1: jaxrec is faster) beside the issue's goal and the
fractions of the ceiling. Every line names the machine (CPU model, cores,
cache sizes) and the 1-minute load average (above the thread count: other
jobs shared the cores). Exits 1 if outputs disagree.

    python bench/compare_torchrec.py --preset tiny            # a smoke test
    python bench/compare_torchrec.py --preset issue --reps 15 # the issue's three configs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

os.environ.setdefault("JAXREC_CPU_THREADS", str(len(os.sched_getaffinity(0))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import (  # noqa: E402
    EPS,
    build_jaxrec,
    build_torchrec,
    jaxrec_kjt,
    machine,
    record,
    torchrec_available,
    torchrec_kjt,
)
from flax import nnx  # noqa: E402
from specs import LookupSpec, make_inputs  # noqa: E402

from jaxrec import EmbeddingTable, cpu, optim  # noqa: E402
from jaxrec.embedding import CombinedOptimizer  # noqa: E402
from jaxrec.train import init_train_state, make_train_step  # noqa: E402

BENCH = "compare_torchrec"
CONFIGS: dict[str, LookupSpec] = {
    "tiny": LookupSpec(T=2, E=1000, D=16, B=32, L=4),
    "tiny_zipf": LookupSpec(T=2, E=1000, D=16, B=32, L=4, alpha=1.05),
    # The configurations.
    "default": LookupSpec(T=8, E=1_000_000, D=128, B=4096, L=20),
    "criteo": LookupSpec(T=26, E=100_000, D=64, B=2048, L=1),
    "zipf": LookupSpec(T=8, E=1_000_000, D=128, B=4096, L=20, alpha=1.05),
}
PRESETS = {"tiny": ("tiny", "tiny_zipf"), "issue": ("default", "criteo", "zipf")}
IDLE_S = 0.05  # pause before each timed call (not timed); --idle-ms
# Bytes of an unrelated buffer read before each turn (not timed), so that no
# call finds the rows of the one before it in the caches; --evict-mb (0: off).
EVICT_BYTES = 0
_SCRATCH: list[np.ndarray] = []
BLOCK = 1  # calls per turn; with > 1 the first of each turn is untimed; --block
GOALS = {"forward": 1.3, "train": 1.2}  # the ratios: TorchRec time / jaxrec time
OPT_EPS = 1e-8
OPTIMIZERS: dict[str, tuple[str, Callable]] = {
    "rowwise_adagrad": ("EXACT_ROWWISE_ADAGRAD", lambda lr: optim.rowwise_adagrad(lr, OPT_EPS)),
    "sgd": ("EXACT_SGD", lambda lr: optim.sgd(lr)),
}


MACHINE = machine()
GATHER_AHEADS = (0, 4, 8, 16, 32)  # prefetch distances tried for the gather ceiling
READ_CAP = 1 << 30  # bytes of the table read sequentially
CEILINGS: dict[str, dict] = {}  # config -> the forward's ceilings in this run (GB/s)


def threads() -> int:
    return int(os.environ["JAXREC_CPU_THREADS"])


def calls_per_fn(reps: int, warmup: int) -> int:
    """How many times ``interleaved`` calls each function."""
    return warmup + reps * BLOCK


def interleaved(fns: dict[str, Callable[[], None]], reps: int, warmup: int) -> dict:
    """Wall times (ms) of each ``fn()``, turns interleaved across ``fns``.

    A turn reads ``EVICT_BYTES`` of an unrelated buffer (``evict``), idles
    ``IDLE_S`` (the other framework's worker threads: torch's OpenMP pool spins
    after each op and must not eat the cores of the next call), then calls
    ``fn`` ``BLOCK`` times. ``BLOCK == 1``: every call starts cold (idle cores,
    caches holding none of the rows). ``BLOCK > 1``: the
    first call of a turn is untimed and the rest run back to back, as in a
    training loop. A ``fn`` that returns a number gives its own time (seconds).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(reps):
        order = list(fns) if i % 2 == 0 else list(reversed(fns))
        for k in order:
            evict()
            time.sleep(IDLE_S)
            for j in range(BLOCK):
                start = time.perf_counter()
                own = fns[k]()
                took = own if isinstance(own, float) else time.perf_counter() - start
                if BLOCK == 1 or j > 0:
                    times[k].append(took * 1e3)
    return times


def cache_bytes() -> int:
    """The largest cache's size (the L3 here), from the machine's line; 0 if unknown."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = [int(v[:-1]) * units[v[-1]] for v in MACHINE["caches"].values() if v[-1:] in units]
    return max(sizes, default=0)


def evict() -> None:
    """Reads ``EVICT_BYTES`` of a buffer no call uses: what the previous call left in the
    caches (the same rows, for the gathers and jaxrec's own next call; TorchRec reads its
    own copy of the table) is gone, so every call of the cold protocol starts alike."""
    if not EVICT_BYTES:
        return
    if not _SCRATCH:
        _SCRATCH.append(np.ones(EVICT_BYTES // 4, np.float32))
    cpu.read_bandwidth(_SCRATCH[0], threads())


def fractions(name, times, bytes_moved) -> dict:
    """Each framework's bandwidth over this run's ceilings for ``name`` (1.0: at the ceiling)."""
    ceil = CEILINGS.get(name)
    if not ceil or not bytes_moved:
        return {}
    out = {
        "gather_gbps": round(ceil["gather"], 3),
        "gather_pool_gbps": round(ceil["gather_pool"], 3),
        "read_gbps": round(ceil["read"], 3),
    }
    for fw in ("jaxrec", "torchrec"):
        gbps = bytes_moved / (statistics.median(times[fw]) * 1e-3) / 1e9
        out[f"{fw}_gbps"] = round(gbps, 3)
        for c in ("gather", "gather_pool", "read"):
            out[f"{fw}_fraction_of_{c}"] = round(gbps / ceil[c], 3)
    return out


def ratio_line(name, spec, phase, times, impl, bytes_moved=None, **extra) -> dict:
    ratio = statistics.median(times["torchrec"]) / statistics.median(times["jaxrec"])
    goal = GOALS["forward" if phase == "forward" else "train"]
    return {
        "bench": BENCH,
        "impl": "ratio",
        "config": name,
        "phase": phase,
        "jaxrec_impl": impl,
        **spec.as_dict(),
        "threads": threads(),
        "block": BLOCK,
        "idle_ms": IDLE_S * 1e3,
        "evict_mb": EVICT_BYTES >> 20,
        "ratio_jaxrec_over_torchrec": round(ratio, 3),
        "ratio_meaning": "torchrec median_ms / jaxrec median_ms; > 1 means jaxrec is faster",
        "goal": goal,
        "meets_goal": ratio >= goal,
        "bytes_moved": bytes_moved,
        **fractions(name, times, bytes_moved),
        **extra,
    }


def emit(line: dict) -> dict:
    # The load average shows whether other jobs shared the cores during the phase.
    line = {**line, "machine": MACHINE, "loadavg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(line), flush=True)
    return line


# ----- the roofline -----
def forward_ids(spec, inputs) -> np.ndarray:
    """The forward's rows in the stacked ``[T * E, D]`` table, in the kernel's order."""
    ids = inputs["values"].reshape(spec.T, -1) + np.arange(spec.T)[:, None] * spec.E
    return np.ascontiguousarray(ids.reshape(-1), np.int32)


def best_ahead(table, ids, n, reps=3) -> int:
    """The prefetch distance at which ``gather_rows`` is fastest with ``n`` threads."""
    cpu.gather_rows(table, ids, n, 16)  # warm
    med = {}
    for ahead in GATHER_AHEADS:
        med[ahead] = statistics.median(
            cpu.gather_rows(table, ids, n, ahead)[0] for _ in range(reps)
        )
    return min(med, key=med.get)


def read_gbps(table, n, reps=5) -> float:
    """Median sequential read bandwidth of (up to ``READ_CAP`` bytes of) the table, GB/s."""
    flat = table.reshape(-1)[: READ_CAP // 4]
    cpu.read_bandwidth(flat, n)
    secs = []
    for _ in range(reps):
        time.sleep(IDLE_S)
        secs.append(cpu.read_bandwidth(flat, n)[0])
    return flat.nbytes / statistics.median(secs) / 1e9


def gather_fns(spec, inputs, table) -> tuple[dict, dict]:
    """``{"gather_1t", "gather_<n>t", "gather_pool_1t", "gather_pool_<n>t"}`` timed calls over
    the forward's rows, and their settings. ``gather_pool`` also writes the forward's output
    (each bag's sum, in order, into one reused buffer): at L=1 that doubles the traffic."""
    ids = forward_ids(spec, inputs)
    out = np.zeros((spec.T * spec.B, spec.D), np.float32)
    fns, settings = {}, {}
    for n in sorted({1, threads()}):
        ahead = best_ahead(table, ids, n)
        fns[f"gather_{n}t"] = lambda n=n, ahead=ahead: cpu.gather_rows(table, ids, n, ahead)[0]
        fns[f"gather_pool_{n}t"] = lambda n=n, ahead=ahead: cpu.gather_pool_rows(
            table, ids, out, n, ahead
        )
        settings[f"gather_{n}t"] = settings[f"gather_pool_{n}t"] = {
            "threads": n,
            "prefetch_ahead": ahead,
        }
    return fns, settings


def train_bytes(spec, inputs, optimizer) -> int:
    """A train step's modeled traffic: the forward's rows, then each unique row read and
    written back once (row-wise Adagrad: and its one float of state)."""
    ids = inputs["values"].reshape(spec.T, -1)
    unique = sum(len(np.unique(row)) for row in ids)
    per_row = 2 * spec.D * spec.bytes_per_element + (8 if optimizer == "rowwise_adagrad" else 0)
    return spec.bytes_read() + unique * per_row


def _records(name, spec, phase, times, impl, bytes_moved=None, **extra) -> list[dict]:
    out = []
    for fw, t in times.items():
        rec = record(BENCH, spec, fw, t, config=name, phase=phase, threads=threads(), block=BLOCK)
        if fw == "jaxrec":
            rec["jaxrec_impl"] = impl
        if bytes_moved:
            rec["gbps"] = round(bytes_moved / (statistics.median(t) * 1e-3) / 1e9, 3)
        out.append(emit(rec))
    out.append(emit(ratio_line(name, spec, phase, times, impl, bytes_moved, **extra)))
    return out


# ----- forward -----
def run_forward(name, spec, inputs, impl, reps, warmup, seed) -> list[dict]:
    import torch

    ebc = build_jaxrec(spec, seed=seed)
    ebc.implementation = None if impl == "auto" else impl
    (table,) = [np.asarray(w) for w in jax.tree.leaves(nnx.state(ebc, EmbeddingTable))]
    graphdef, state = nnx.split(ebc)
    forward = jax.jit(lambda state, kjt: nnx.merge(graphdef, state)(kjt).values())
    kjt = jaxrec_kjt(spec, inputs)
    tebc = build_torchrec(spec, ebc)
    del ebc
    gc.collect()
    tkjt = torchrec_kjt(inputs, next(iter(tebc.parameters())).dtype)
    gathers, settings = gather_fns(spec, inputs, table)
    seq, read_settings = {}, {}
    for n in sorted({1, threads()}):
        seq[f"read_{n}t"] = read_gbps(table, n)
        read_settings[f"read_{n}t"] = {"threads": n, "bytes": min(table.nbytes, READ_CAP)}
    with torch.no_grad():
        out = np.asarray(forward(state, kjt), np.float32)
        ref = tebc(tkjt).values().float().numpy()
        times = interleaved(
            {
                "jaxrec": lambda: forward(state, kjt).block_until_ready(),
                "torchrec": lambda: tebc(tkjt),
                **gathers,
            },
            reps,
            warmup,
        )
    diff = float(np.max(np.abs(out - ref))) if ref.size else 0.0
    tol = 4 * EPS[spec.dtype] * spec.L * (1.0 / spec.E) ** 0.5
    gb = spec.bytes_read() / 1e9
    ceil = {k: gb / (statistics.median(times.pop(k)) * 1e-3) for k in gathers}
    for k, gbps in {**ceil, **seq}.items():
        emit(
            {
                "bench": BENCH,
                "impl": "ceiling",
                "ceiling": k,
                "config": name,
                **spec.as_dict(),
                "block": BLOCK,
                "gbps": round(gbps, 3),
                **{**settings, **read_settings}[k],
            }
        )
    CEILINGS[name] = {
        "gather": max(v for k, v in ceil.items() if not k.startswith("gather_pool")),
        "gather_pool": max(v for k, v in ceil.items() if k.startswith("gather_pool")),
        "read": max(seq.values()),
        **ceil,
        **seq,
    }
    return _records(
        name,
        spec,
        "forward",
        times,
        impl,
        bytes_moved=spec.bytes_read(),
        max_abs_diff=diff,
        tolerance=tol,
        agree=diff <= tol,
    )


# ----- train step -----
def run_train(name, spec, inputs, optimizer, impl, reps, warmup, seed, lr=0.1) -> list[dict]:
    import torch
    import torch.distributed as dist
    from train_step import Config, build_fused_torchrec

    proj = np.random.default_rng(seed + 1).standard_normal((spec.B, spec.T * spec.D))
    proj = proj.astype(np.float32)
    ebc = build_jaxrec(spec, seed=seed)
    initial = [np.array(w) for w in jax.tree.leaves(nnx.state(ebc, EmbeddingTable))]
    (initial,) = initial  # one stacked [T * E, D] group
    opt = CombinedOptimizer(optax.sgd(0.0), OPTIMIZERS[optimizer][1](lr))
    graphdef, state = init_train_state(ebc, opt)
    del ebc
    loss = lambda m, batch: jnp.sum(m(batch[0]).values() * batch[1])
    step = make_train_step(graphdef, opt, loss, implementation=None if impl == "auto" else impl)
    batch = (jaxrec_kjt(spec, inputs), jnp.asarray(proj))
    box = [state]
    del state

    def jax_one():
        box[0], _, _ = step(box[0], batch)
        jax.block_until_ready(box[0])

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dmp = build_fused_torchrec(spec, Config(optimizer=optimizer, lr=lr))
        weights = [dmp.module.embedding_bags[f"t{t}"].weight for t in range(spec.T)]
        for t, w in enumerate(weights):
            w.detach().numpy()[:] = initial[t * spec.E : (t + 1) * spec.E]
        del initial
        gc.collect()
        tkjt, r = torchrec_kjt(inputs), torch.from_numpy(proj)

        def torch_one():
            (dmp(tkjt).wait().values() * r).sum().backward()

        times = interleaved({"jaxrec": jax_one, "torchrec": torch_one}, reps, warmup)
        # Same steps from the same weights and batch: the touched rows must agree.
        (table,) = jax.tree.leaves(box[0].tables)
        table = np.asarray(table)
        ids = inputs["values"].reshape(spec.T, -1)
        diff, scale = 0.0, 0.0
        for t, w in enumerate(weights):
            rows = np.unique(ids[t])
            mine = table[t * spec.E + rows]
            diff = max(diff, float(np.max(np.abs(mine - w.detach().numpy()[rows]))))
            scale = max(scale, float(np.max(np.abs(mine))))
    finally:
        if created:
            dist.destroy_process_group()
    steps = calls_per_fn(reps, warmup)
    tol = 16 * EPS[spec.dtype] * max(scale, 1e-3) * steps * max(1.0, spec.L**0.5)
    fbgemm = OPTIMIZERS[optimizer][0]
    return _records(
        name,
        spec,
        f"train_{optimizer}",
        times,
        impl,
        bytes_moved=train_bytes(spec, inputs, optimizer),
        optimizer=fbgemm,
        steps=steps,
        max_abs_diff=diff,
        tolerance=tol,
        agree=diff <= tol,
    )


def run(name: str, *, phases, impl="auto", reps=10, warmup=2, seed=0) -> list[dict]:
    """Every requested phase of configuration ``name``; returns the JSON records."""
    import torch

    torch.set_num_threads(threads())
    spec = CONFIGS[name]
    inputs = make_inputs(spec, seed)
    out = []
    for phase in phases:
        if phase == "forward":
            out += run_forward(name, spec, inputs, impl, reps, warmup, seed)
        else:
            out += run_train(name, spec, inputs, phase, impl, reps, warmup, seed)
        gc.collect()
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset", default="tiny", help=f"{sorted(PRESETS)} or configs {sorted(CONFIGS)}"
    )
    p.add_argument("--phases", default="forward,rowwise_adagrad,sgd")
    p.add_argument("--impl", default="auto", choices=("auto", "cpu", "xla"))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-ms", type=float, default=IDLE_S * 1e3, help="pause before each turn")
    p.add_argument(
        "--block", type=int, default=BLOCK, help="calls per turn (> 1: back to back, first untimed)"
    )
    p.add_argument(
        "--evict-mb",
        type=int,
        default=None,
        help="MiB read before each turn to empty the caches (default: twice the L3; 0: off)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    global IDLE_S, BLOCK, EVICT_BYTES
    args = parse_args(argv)
    IDLE_S = args.idle_ms / 1e3
    EVICT_BYTES = 2 * cache_bytes() if args.evict_mb is None else args.evict_mb << 20
    BLOCK = max(1, args.block)
    if not torchrec_available():
        emit({"bench": BENCH, "skipped": "torchrec is not importable"})
        return 0
    names = []
    for n in args.preset.split(","):
        names += PRESETS.get(n, (n,))
    unknown = [n for n in names if n not in CONFIGS]
    phases = args.phases.split(",")
    if unknown or set(phases) - {"forward", *OPTIMIZERS}:
        raise SystemExit(f"unknown configs {unknown} or phases {phases}")
    agree = True
    for name in names:
        recs = run(
            name,
            phases=phases,
            impl=args.impl,
            reps=args.reps,
            warmup=args.warmup,
            seed=args.seed,
        )
        agree &= all(r.get("agree", True) for r in recs)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
