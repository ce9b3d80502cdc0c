"""Build and compile time against table count (issue: hundreds of tables).

For each table count ``T`` (one feature per table, rows log-uniform in
``[--min-rows, --max-rows]``, dims cycling through ``--dims``) it measures, in
one process:

* ``unsharded_build_s``: ``EmbeddingBagCollection(tables)`` plus a dense head;
* ``sharded_build_s``: the same model planned (``plan=None``) and sharded over
  ``--devices`` CPU devices by ``DistributedModelParallel``;
* ``rng_floor_s``: drawing all the tables' values in one precompiled call (the
  floor of the build: what remains is per-table overhead);
* ``trace_s``, ``lower_s``, ``compile_s``: the first train step's trace, lowering
  and trace + lower + compile in all (sharded);
* ``step_ms``: the steady step's median over ``--reps``;
* ``hlo_kb``: the compiled program's HLO text size;
* ``movielens_build_s``: the 8-table MovieLens DLRM's cold build (``--movielens``).

Total ids per batch (``L = --ids-per-sample // T`` ids per bag) and total rows
(``--total-rows``) are equal across ``T``, so step time and HLO size should follow
width groups, not tables.
Every build is cold for its shapes (a fresh process per ``T`` is not needed:
each ``T`` has new table sizes), except what JAX caches across ``T`` (the same
dims' programs). One JSON line per ``T``::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/build_compile.py
    python bench/build_compile.py --tables 50,100,500 --movielens
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin, if installed, stays out

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import cpu_model, emit  # noqa: E402
from flax import nnx  # noqa: E402

import jaxrec as jr  # noqa: E402
from jaxrec import distributed as d  # noqa: E402
from jaxrec import optim, train  # noqa: E402
from jaxrec.embedding import CombinedOptimizer  # noqa: E402
from jaxrec.modules.initializers import torch_linear  # noqa: E402


def make_tables(n, *, dims, min_rows, max_rows, total_rows=None, seed=0):
    """Rows log-uniform in ``[min_rows, max_rows]``, scaled to ``total_rows`` if given (so
    that table counts compare at equal memory: random row access slows down as the
    tables outgrow the caches, whatever their number)."""
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
        )  # fmt: skip
        for i in range(n)
    ]


class Model(nnx.Module):
    def __init__(self, tables, *, rngs):
        self.ebc = jr.EmbeddingBagCollection(tables, rngs=rngs)
        self.head = torch_linear(sum(t.embedding_dim for t in tables), 1, rngs=rngs)

    def __call__(self, kjt):
        return self.head(self.ebc(kjt).values())[:, 0]


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


def timed(fn):
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(jax.tree.leaves(nnx.state(out)) if isinstance(out, nnx.Module) else out)
    return out, time.perf_counter() - start


def rng_floor_s(tables) -> float:
    """One jitted uniform draw of every table value at once, compiled beforehand: the
    build's floor (drawing the values), which no per-table saving can go below."""
    n = sum(t.num_embeddings * t.embedding_dim for t in tables)
    draw = jax.jit(lambda k: jax.random.uniform(k, (n,)))
    jax.block_until_ready(draw(jax.random.key(0)))
    start = time.perf_counter()
    jax.block_until_ready(draw(jax.random.key(1)))
    return time.perf_counter() - start


def run(n, args):
    tables = make_tables(
        n, dims=args.dims, min_rows=args.min_rows, max_rows=args.max_rows,
        total_rows=args.total_rows,
    )  # fmt: skip
    model, unsharded_s = timed(lambda: Model(tables, rngs=nnx.Rngs(0)))
    mesh = jax.make_mesh((args.devices,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    opt = CombinedOptimizer(optax.adagrad(0.01), optim.rowwise_adagrad(0.01))
    sharded, sharded_s = timed(
        lambda: d.DistributedModelParallel(Model(tables, rngs=nnx.Rngs(0)), None, mesh)
    )
    graphdef, state = train.init_train_state(sharded, opt)
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
        )  # fmt: skip
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
        "tables": n,
        "groups": len(model.ebc.groups),
        "rows": sum(t.num_embeddings for t in tables),
        "unsharded_build_s": round(unsharded_s, 3),
        "sharded_build_s": round(sharded_s, 3),
        "rng_floor_s": round(rng_floor_s(tables), 3),
        "trace_s": round(trace_s, 2),
        "lower_s": round(lower_s, 2),
        "compile_s": round(compile_s, 2),
        "step_ms": round(1e3 * float(np.median(times[2:])), 2),
        "hlo_kb": round(hlo_kb, 1),
        "first_step_s": round(times[0], 2),
    }


# ml-100k's 8 sparse features as the job builds them (user, item, age, gender,
# occupation, zip prefix, genres, year bucket): about 100k parameters at dim 16.
MOVIELENS_ROWS = [944, 1683, 62, 3, 22, 796, 20, 72]


def movielens_build_s():
    """The job's MovieLens DLRM (dim 16, dense [64, 16], over [64, 32, 1]), built cold."""
    from jaxrec.models import DLRM  # noqa: PLC0415

    def build():
        tables = [
            jr.EmbeddingBagConfig(
                name=f"t{i}", embedding_dim=16, num_embeddings=n, feature_names=[f"f{i}"]
            )  # fmt: skip
            for i, n in enumerate(MOVIELENS_ROWS)
        ]
        ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
        return DLRM(
            embedding_bag_collection=ebc, dense_in_features=1, dense_arch_layer_sizes=[64, 16],
            over_arch_layer_sizes=[64, 32, 1], rngs=nnx.Rngs(1),
        )  # fmt: skip

    return timed(build)[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", default="50,100,500")
    p.add_argument("--dims", default="16,32,64,128")
    p.add_argument("--min-rows", type=int, default=100)
    p.add_argument("--max-rows", type=int, default=10_000)
    p.add_argument(
        "--total-rows", type=int, default=1_000_000, help="all tables' rows (0: unscaled)"
    )
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--batch", type=int, default=64, help="per device")
    p.add_argument("--ids-per-sample", type=int, default=500)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--movielens", action="store_true")
    args = p.parse_args()
    args.dims = [int(x) for x in args.dims.split(",")]
    base = {"bench": "build_compile", "cpu": cpu_model(), "cores": os.cpu_count(),
            "jax_version": jax.__version__, "devices": args.devices, "batch": args.batch,
            "ids_per_sample": args.ids_per_sample, "total_rows": args.total_rows}  # fmt: skip
    if args.movielens:
        emit({**base, "case": "movielens_dlrm", "build_s": round(movielens_build_s(), 3)})
    for n in [int(x) for x in args.tables.split(",")]:
        emit({**base, "case": "tables", **run(n, args)})


if __name__ == "__main__":
    main()
