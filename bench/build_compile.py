"""Build and compile at realistic row counts: initial values at memory speed, sharded builds.

For each table count ``T`` (one feature per table, rows log-uniform in
``[--min-rows, --max-rows]`` scaled to ``--total-rows`` in all, dims cycling
through ``--dims``, dtypes through ``--dtypes``) it measures, in one process:

* ``draw_gbps``: the tables' initial values drawn by the eager build's programs
  (``jaxrec.ops.init.uniform_rows``, one per width group, compiled beforehand),
  bytes written per second; ``numpy_gbps``: numpy's ``default_rng().random`` filling
  the same number of float32 bytes into a preallocated buffer in the same run (its
  generator, PCG64, on one core), and ``threefry_gbps`` for ``jax.random.uniform`` of
  those float32 values (JAX's default generator); per core: divided by the cores the
  process may use;
* ``unsharded_build_s``: ``EmbeddingBagCollection(tables)`` plus a dense head, cold;
* per plan (``--plans``: ``planner``; ``table_wise``, each table whole on the rank with
  the fewest rows of its width group so far, largest first): ``sharded_build_s``, the model
  built from its constructor by ``DistributedModelParallel`` over ``--devices`` CPU
  devices (each device draws its own shards; the planner's time included),
  ``build_peak_growth`` (growth of the process's peak resident memory over the build;
  CPU devices live in host memory) against ``table_bytes`` and ``buffer_bytes`` (the
  sharded buffers, each width group padded to its fullest rank), then the first train
  step's ``trace_s``, ``lower_s`` and ``compile_s`` (trace + lower + compile), the
  steady ``step_ms`` over ``--reps`` and the compiled ``hlo_kb``.

Every plan uses the default ``overflow="exact"``. One JSON line per (``T``, plan)::

    python bench/build_compile.py                      # 300 tables, 10M rows, 4 dims
    python bench/build_compile.py --tables 50,300,1000 --dtypes fp32,bf16 --out r.jsonl
"""

from __future__ import annotations

import argparse
import gc
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin, if installed, stays out

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import emit, machine  # noqa: E402
from flax import nnx  # noqa: E402

import jaxrec as jr  # noqa: E402
from jaxrec import distributed as d  # noqa: E402
from jaxrec import optim, train  # noqa: E402
from jaxrec.embedding import CombinedOptimizer, EmbeddingTable  # noqa: E402
from jaxrec.modules.initializers import torch_linear  # noqa: E402
from jaxrec.ops.init import TablePiece, uniform_rows  # noqa: E402

DTYPES = {"fp32": jr.DataType.FP32, "bf16": jr.DataType.BF16, "fp16": jr.DataType.FP16}


def make_tables(n, *, dims, dtypes, min_rows, max_rows, total_rows=None, seed=0):
    """Rows log-uniform in ``[min_rows, max_rows]``, scaled to ``total_rows`` if given."""
    rng = np.random.default_rng(seed)
    rows = np.exp(rng.uniform(np.log(min_rows), np.log(max_rows), n))
    if total_rows:
        rows = rows * total_rows / rows.sum()
    rows = np.maximum(rows.astype(int), 1)
    return [
        jr.EmbeddingBagConfig(
            name=f"t{i}",
            num_embeddings=int(rows[i]),
            embedding_dim=dims[i % len(dims)],
            feature_names=[f"f{i}"],
            data_type=DTYPES[dtypes[(i // len(dims)) % len(dtypes)]],
        )
        for i in range(n)
    ]


class Model(nnx.Module):
    def __init__(self, tables, *, rngs):
        self.ebc = jr.EmbeddingBagCollection(tables, rngs=rngs)
        self.head = torch_linear(sum(t.embedding_dim for t in tables), 1, rngs=rngs)

    def __call__(self, kjt):
        return self.head(self.ebc(kjt).values().astype(jnp.float32))[:, 0]


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def local_batches(tables, *, world, batch, ids_per_sample, seed=1):
    rng = np.random.default_rng(seed)
    per_bag = max(1, ids_per_sample // len(tables))
    keys = [t.feature_names[0] for t in tables]
    out = []
    for _ in range(world):
        values = np.concatenate(
            [rng.integers(0, t.num_embeddings, batch * per_bag) for t in tables]
        )
        lengths = np.full(len(tables) * batch, per_bag)
        kjt = jr.KeyedJaggedTensor.from_lengths_sync(
            keys, values, lengths, capacities={k: batch * per_bag for k in keys}
        )
        out.append((kjt, rng.normal(size=batch).astype(np.float32)))
    return out


def table_bytes(tables) -> int:
    return sum(t.num_embeddings * t.embedding_dim * np.dtype(t.dtype).itemsize for t in tables)


def reset_peak() -> None:
    """Resets the process's peak resident memory to its current size (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the peak includes earlier ones: an overestimate


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        return 1024 * next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(jax.tree.leaves(nnx.state(out)) if isinstance(out, nnx.Module) else out)
    return out, time.perf_counter() - start


def draw_rates(model, tables, reps: int) -> dict:
    """The eager build's draws (one program per width group, compiled beforehand) and
    numpy's fill of the same bytes, best of ``reps``."""
    ebc = model.ebc
    key = jax.random.key(0)
    draws = []
    for g in ebc.groups:
        cfgs = [ebc.config(n) for n in g.tables]
        pieces = [
            TablePiece(
                off,
                c.num_embeddings,
                i,
                0,
                0,
                c.embedding_dim,
                c.get_weight_init_min(),
                c.get_weight_init_max(),
            )
            for i, (c, off) in enumerate(zip(cfgs, g.row_offsets, strict=True))
        ]
        draws.append((pieces, g.num_rows, g.embedding_dim, cfgs[0].dtype))

    def draw_all():
        return [uniform_rows(key, *d) for d in draws]

    jax.block_until_ready(draw_all())  # compiled, and the output pages touched once
    nbytes = table_bytes(tables)
    threefry = jax.jit(lambda k: jax.random.uniform(k, (nbytes // 4,), jnp.float32, -0.1, 0.1))
    jax.block_until_ready(threefry(key))
    jax_s, np_s, tf_s = [], [], []
    buf = np.empty(nbytes // 4, np.float32)
    rng = np.random.default_rng(0)
    rng.random(buf.size, dtype=np.float32, out=buf)
    for _ in range(reps):
        start = time.perf_counter()
        out = draw_all()
        jax.block_until_ready(out)
        jax_s.append(time.perf_counter() - start)
        del out
        start = time.perf_counter()
        rng.random(buf.size, dtype=np.float32, out=buf)
        np_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        jax.block_until_ready(threefry(key))
        tf_s.append(time.perf_counter() - start)
    del buf
    cores = len(os.sched_getaffinity(0))
    draw, fill = nbytes / min(jax_s) / 1e9, nbytes / min(np_s) / 1e9
    return {
        "draw_gbps": round(draw, 2),
        "draw_gbps_per_core": round(draw / cores, 2),
        "numpy_gbps": round(fill, 2),
        "draw_over_numpy": round(draw / fill, 2),
        "threefry_gbps": round(nbytes / min(tf_s) / 1e9, 2),
    }


def plan_for(kind: str, make, tables, mesh):
    if kind == "planner":
        return None
    n = mesh.size
    abstract = nnx.eval_shape(make)
    # Largest first onto the rank with the fewest bytes of its width group: a width
    # group's buffer is as large as its fullest rank's shards.
    load: dict = {}
    gens = {}
    for t in sorted(tables, key=lambda t: -t.num_embeddings):
        ranks = load.setdefault((t.embedding_dim, t.data_type), [0] * n)
        rank = int(np.argmin(ranks))
        ranks[rank] += t.num_embeddings
        gens[t.name] = d.table_wise(rank)
    return d.ShardingPlan(
        {"ebc": d.construct_module_sharding_plan(abstract.ebc, gens, world_size=n)}
    )


def run_plan(kind, tables, args, mesh):
    make = lambda: Model(tables, rngs=nnx.Rngs(0))  # noqa: E731
    gc.collect()
    reset_peak()
    before = peak_bytes()
    start = time.perf_counter()
    sharded = d.DistributedModelParallel(make, plan_for(kind, make, tables, mesh), mesh)
    jax.block_until_ready(jax.tree.leaves(nnx.state(sharded)))
    build_s = time.perf_counter() - start
    growth = peak_bytes() - before
    leaves = jax.tree.leaves(nnx.state(sharded, EmbeddingTable))
    buffers = sum(x.nbytes for x in leaves)  # padded up to each group's fullest rank
    opt = CombinedOptimizer(optax.adagrad(0.01), optim.rowwise_adagrad(0.01))
    graphdef, state = train.init_train_state(sharded, opt)
    del sharded
    step = train.make_train_step(graphdef, opt, loss_fn)
    data = [
        d.shard_batch(
            local_batches(
                tables,
                world=args.devices,
                batch=args.batch,
                ids_per_sample=args.ids_per_sample,
                seed=s,
            ),
            mesh,
        )
        for s in range(2)
    ]
    start = time.perf_counter()
    traced = step.jitted.trace(state, data[0])
    trace_s = time.perf_counter() - start
    lowered = traced.lower()
    lower_s = time.perf_counter() - start - trace_s
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    hlo_kb = len(compiled.as_text()) / 1024
    del compiled
    times = []
    for i in range(args.reps + 1):
        t0 = time.perf_counter()
        state, loss, _ = step(state, data[i % 2])
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    return {
        "plan": kind,
        "sharded_build_s": round(build_s, 2),
        "build_peak_growth": growth,
        "build_peak_over_tables": round(growth / table_bytes(tables), 3),
        "buffer_bytes": buffers,
        "build_peak_over_buffers": round(growth / buffers, 3),
        "trace_s": round(trace_s, 2),
        "lower_s": round(lower_s, 2),
        "compile_s": round(compile_s, 2),
        "step_ms": round(1e3 * float(np.median(times[1:])), 2),  # after the first step
        "hlo_kb": round(hlo_kb, 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", default="300")
    p.add_argument("--dims", default="16,32,64,128")
    p.add_argument("--dtypes", default="fp32", help=f"cycled over tables, from {list(DTYPES)}")
    p.add_argument("--min-rows", type=int, default=1_000)
    p.add_argument("--max-rows", type=int, default=1_000_000)
    p.add_argument("--total-rows", type=int, default=10_000_000, help="all tables' rows")
    p.add_argument("--plans", default="planner,table_wise")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--batch", type=int, default=64, help="per device")
    p.add_argument("--ids-per-sample", type=int, default=500)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    dims = [int(x) for x in args.dims.split(",")]
    dtypes = args.dtypes.split(",")
    base = {
        "bench": "build_compile",
        **machine(),
        "jax_version": jax.__version__,
        "devices": args.devices,
        "batch": args.batch,
        "ids_per_sample": args.ids_per_sample,
        "total_rows": args.total_rows,
        "dims": dims,
        "dtypes": dtypes,
        "overflow": "exact",
    }
    mesh = jax.make_mesh((args.devices,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    for n in [int(x) for x in args.tables.split(",")]:
        tables = make_tables(
            n,
            dims=dims,
            dtypes=dtypes,
            min_rows=args.min_rows,
            max_rows=args.max_rows,
            total_rows=args.total_rows,
        )
        model, unsharded_s = timed(lambda: Model(tables, rngs=nnx.Rngs(0)))  # noqa: B023
        common = {
            **base,
            "tables": n,
            "groups": len(model.ebc.groups),
            "rows": sum(t.num_embeddings for t in tables),
            "table_bytes": table_bytes(tables),
            "unsharded_build_s": round(unsharded_s, 2),
            **draw_rates(model, tables, args.reps),
        }
        del model
        for kind in args.plans.split(","):
            emit({**common, **run_plan(kind, tables, args, mesh)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
