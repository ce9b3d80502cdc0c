"""Pipelined input distribution on 8 CPU devices: the sparse-dist step against the plain one.

A DLRM (``bench/pipeline.py``'s: bottom MLP ``[64, D]``, top ``[128, 64, 1]``)
whose ``T`` tables ``"t<i>"`` alternate row-wise (even ``i``) and table-wise
(odd ``i``, on rank ``i % 8``) over 8 fake CPU devices
(``--xla_force_host_platform_device_count=8``, set before JAX starts),
``B`` samples per device with ``L`` ids per bag, trained with Adam and
row-wise Adagrad; ``--overflow count`` drops ids beyond the fast path
instead of sending them in extra rounds (no round loops in either step).
Per-step wall time, median over ``--reps`` runs of ``--steps`` steps, on
batches already on the devices:

* ``step``: :func:`jaxrec.train.make_train_step`, one step at a time
  (each waited for);
* ``sparse_dist_step``: :func:`jaxrec.train.make_sparse_dist_train_step`,
  likewise: each step consumes the ids the previous one sent and sends the
  next batch's;

and end to end from host batches (preparation, transfer, step):
``pipeline`` (:class:`~jaxrec.train.TrainPipeline`) and
``pipeline_sparse_dist`` (:class:`~jaxrec.train.TrainPipelineSparseDist`).
Prints one JSON line per mode (``cpu`` names the machine's CPU,
``load_avg_1m`` the machine's load when the runs ended), then a ``ratios``
line (plain over pipelined). Modes alternate within each rep, so a load that
drifts weighs on all of them alike.

Run from the repository root::

    JAX_PLATFORMS=cpu python bench/sparse_dist.py --preset small --B 256 --L 10 --reps 7
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import add_spec_args, build_jaxrec, emit, record, specs_from_args  # noqa: E402
from flax import nnx  # noqa: E402
from pipeline import NUM_DENSE, bce, host_batch  # noqa: E402
from specs import LookupSpec  # noqa: E402

from jaxrec import distributed as d  # noqa: E402
from jaxrec import train  # noqa: E402
from jaxrec.embedding import CombinedOptimizer  # noqa: E402
from jaxrec.models import DLRM  # noqa: E402
from jaxrec.optim import rowwise_adagrad  # noqa: E402

WORLD = 8


def build(spec: LookupSpec, make, overflow: str = "exact"):
    """``(step, state, mesh)`` of the sharded DLRM, its step made by ``make``."""
    mesh = jax.make_mesh((WORLD,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    model = DLRM(
        embedding_bag_collection=build_jaxrec(spec),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[64, spec.D],
        over_arch_layer_sizes=[128, 64, 1],
        rngs=nnx.Rngs(1),
    )
    gens = {f"t{t}": d.row_wise() if t % 2 == 0 else d.table_wise(t % WORLD) for t in range(spec.T)}
    ebc = model.sparse_arch.embedding_bag_collection
    plan = d.construct_module_sharding_plan(ebc, gens, world_size=WORLD, local_size=WORLD)
    model = d.DistributedModelParallel(
        model,
        d.ShardingPlan({"sparse_arch.embedding_bag_collection": plan}),
        mesh,
        pooling_factors={f"f{t}": float(spec.L) for t in range(spec.T)},
        overflow=overflow,
    )
    opt = CombinedOptimizer(optax.adam(1e-3), rowwise_adagrad(0.05))
    graphdef, state = train.init_train_state(model, opt)
    return make(graphdef, opt, bce), state, mesh


def local_batches(spec: LookupSpec, rng: np.random.Generator) -> list:
    return [host_batch(spec, rng) for _ in range(WORLD)]


def run(spec: LookupSpec, steps: int, reps: int, overflow: str = "exact") -> list[dict]:
    rng = np.random.default_rng(0)
    host = [local_batches(spec, rng) for _ in range(steps + 1)]
    times: dict[str, list[float]] = {
        m: [] for m in ("step", "sparse_dist_step", "pipeline", "pipeline_sparse_dist")
    }
    plain, p_state, mesh = build(spec, train.make_train_step, overflow)
    sparse, s_state, _ = build(spec, train.make_sparse_dist_train_step, overflow)
    dev = [d.shard_batch(b, mesh) for b in host]
    p_state, loss, _ = plain(p_state, dev[0])  # compile
    ids = sparse.input_dist(s_state, dev[0])
    s_state, loss, _, ids = sparse(s_state, ids, dev[0], dev[1])
    jax.block_until_ready((loss, ids))
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(steps):
            p_state, loss, _ = plain(p_state, dev[i])
            jax.block_until_ready(loss)
        times["step"].append((time.perf_counter() - t0) * 1e3 / steps)

        ids = sparse.input_dist(s_state, dev[0])  # priming is outside the timed steps
        jax.block_until_ready(ids)
        t0 = time.perf_counter()
        for i in range(steps):
            s_state, loss, _, ids = sparse(s_state, ids, dev[i], dev[i + 1])
            jax.block_until_ready(loss)
        times["sparse_dist_step"].append((time.perf_counter() - t0) * 1e3 / steps)

        for mode, cls, step in (
            ("pipeline", train.TrainPipeline, plain),
            ("pipeline_sparse_dist", train.TrainPipelineSparseDist, sparse),
        ):
            state = p_state if mode == "pipeline" else s_state
            pipeline = cls(step, state, mesh=mesh)
            loader = iter(host[:steps])
            t0 = time.perf_counter()
            while True:
                try:
                    pipeline.progress(loader)
                except StopIteration:
                    break
            jax.block_until_ready(pipeline.state)
            times[mode].append((time.perf_counter() - t0) * 1e3 / steps)
            if mode == "pipeline":
                p_state = pipeline.state
            else:
                s_state = pipeline.state
    load = round(os.getloadavg()[0], 2)  # other jobs on the machine: the timings' noise
    extra = dict(steps=steps, devices=WORLD, plan="row_wise+table_wise", overflow=overflow)
    out = [
        record("sparse_dist", spec, mode, t, load_avg_1m=load, **extra) for mode, t in times.items()
    ]
    med = {r["impl"]: r["median_ms"] for r in out}
    out.append(
        {
            "bench": "sparse_dist",
            "impl": "ratios",
            **spec.as_dict(),
            "cpu": out[0]["cpu"],
            "step_over_sparse_dist_step": round(med["step"] / med["sparse_dist_step"], 3),
            "pipeline_over_pipeline_sparse_dist": round(
                med["pipeline"] / med["pipeline_sparse_dist"], 3
            ),
        }
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spec_args(p)
    p.add_argument("--steps", type=int, default=10, help="steps per timed run")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--overflow",
        default="exact",
        choices=("exact", "count"),
        help="the sharded collection's overflow mode (count: no extra rounds)",
    )
    p.add_argument("--out", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    for spec in specs_from_args(args):
        for line in run(spec, args.steps, args.reps, args.overflow):
            emit(line, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
