"""TrainPipeline benchmark: overlapped vs sequential DLRM training steps.

Each batch is prepared on the host the way a data loader would (ids drawn,
``KeyedJaggedTensor.from_lengths_sync(..., on_host=True)``, dense features and
labels), transferred, and trained on with row-wise Adagrad. Timed per batch,
median over ``--reps`` runs of ``--steps`` batches:

* ``host_prep``: preparing one batch alone;
* ``step_only``: one step on a batch already on the device;
* ``sequential``: prepare, transfer, step, wait, one batch after another;
* ``pipelined``: :class:`jaxrec.train.TrainPipeline` (preparation and transfer
  of the next batches in a background thread while the step runs).

The ideal pipelined time is ``max(host_prep, step_only)``, the sequential one
their sum. Prints one JSON line per mode, then a ``ratios`` line.

``--compare-steps`` instead times the three train pipelines on batches already
on the device (no host work), one shared state handed from one to the next,
modes interleaved in each rep: ``sync`` (:class:`TrainPipeline`),
``sparse_dist`` (:class:`TrainPipelineSparseDist`; on an unsharded model it has
no ids to send ahead) and ``semi_sync`` (:class:`TrainPipelineSemiSync`:
embeddings looked up a step ahead), then a ``ratios`` line against ``sync``.

Run from the repository root::

    python bench/pipeline.py --preset small --steps 20 --reps 3
    python bench/pipeline.py --preset small --E 2500000 --alpha 1.15 --compare-steps
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import jax
import numpy as np
import optax
from common import add_spec_args, build_jaxrec, emit, machine, record, specs_from_args  # noqa: E402
from flax import nnx
from specs import LookupSpec, zipf_ids  # noqa: E402

from jaxrec import KeyedJaggedTensor
from jaxrec.embedding import CombinedOptimizer
from jaxrec.models import DLRM
from jaxrec.optim import rowwise_adagrad
from jaxrec.train import (
    TrainPipeline,
    TrainPipelineSemiSync,
    TrainPipelineSparseDist,
    init_train_state,
    make_semi_sync_train_step,
    make_sparse_dist_train_step,
    make_train_step,
)

NUM_DENSE = 13


def host_batch(spec: LookupSpec, rng: np.random.Generator):
    """One ``(dense, kjt, labels)`` batch on the host, as a data loader builds it."""
    n = spec.T * spec.B * spec.L
    ids = rng.integers(0, spec.E, n) if spec.alpha == 0 else zipf_ids(rng, spec.E, spec.alpha, n)
    lengths = np.full(spec.T * spec.B, spec.L, np.int32)
    keys = [f"f{t}" for t in range(spec.T)]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys, ids, lengths, capacities=spec.B * spec.L, on_host=True
    )
    dense = rng.standard_normal((spec.B, NUM_DENSE)).astype(np.float32)
    labels = (rng.random(spec.B) < 0.25).astype(np.float32)
    return dense, kjt, labels


def bce(model, batch):
    dense, kjt, labels = batch
    return optax.sigmoid_binary_cross_entropy(model(dense, kjt)[:, 0], labels).mean()


def build(spec: LookupSpec, makers=(make_train_step,)):
    """The DLRM's state and one step per factory in ``makers`` (one step when one)."""
    model = DLRM(
        embedding_bag_collection=build_jaxrec(spec),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[64, spec.D],
        over_arch_layer_sizes=[128, 64, 1],
        rngs=nnx.Rngs(1),
    )
    opt = CombinedOptimizer(optax.adam(1e-3), rowwise_adagrad(0.05))
    graphdef, state = init_train_state(model, opt)
    steps = [make(graphdef, opt, bce) for make in makers]
    return (steps[0] if len(steps) == 1 else steps), state


PIPELINES = {
    "sync": (make_train_step, TrainPipeline),
    "sparse_dist": (make_sparse_dist_train_step, TrainPipelineSparseDist),
    "semi_sync": (make_semi_sync_train_step, TrainPipelineSemiSync),
}


def compare_steps(spec: LookupSpec, steps: int, reps: int, depth: int) -> list[dict]:
    """Per-step time of each train pipeline over the same device batches."""
    made, state = build(spec, [make for make, _ in PIPELINES.values()])
    rng = np.random.default_rng(0)
    batches = [jax.device_put(host_batch(spec, rng)) for _ in range(steps)]
    times: dict[str, list[float]] = {m: [] for m in PIPELINES}
    for rep in range(reps + 1):  # rep 0 compiles
        for (mode, (_, cls)), step in zip(PIPELINES.items(), made, strict=True):
            pipeline = cls(step, state, to_device=lambda b: b, depth=depth)
            it = iter(batches)
            t0 = time.perf_counter()
            while True:
                try:
                    pipeline.progress(it)
                except StopIteration:
                    break
            jax.block_until_ready(pipeline.state)
            if rep:
                times[mode].append((time.perf_counter() - t0) * 1e3 / steps)
            state = pipeline.state
    out = [record("pipeline", spec, mode, t, steps=steps) for mode, t in times.items()]
    med = {r["impl"]: r["median_ms"] for r in out}
    ratios = {f"{m}_over_sync": round(med[m] / med["sync"], 3) for m in PIPELINES if m != "sync"}
    out.append(
        {"bench": "pipeline", "impl": "ratios", **spec.as_dict(), **ratios, "machine": machine()}
    )
    return out


def run(spec: LookupSpec, steps: int, reps: int, depth: int) -> list[dict]:
    step, state = build(spec)
    rng = np.random.default_rng(0)
    batch = jax.device_put(host_batch(spec, rng))
    state, loss, _ = step(state, batch)  # compile
    jax.block_until_ready(loss)
    times: dict[str, list[float]] = {m: [] for m in ("host_prep", "step_only", "sequential")}
    times["pipelined"] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(steps):
            host_batch(spec, rng)
        times["host_prep"].append((time.perf_counter() - t0) * 1e3 / steps)

        t0 = time.perf_counter()
        for _ in range(steps):
            state, loss, _ = step(state, batch)
            jax.block_until_ready(loss)  # as sequential: one step at a time
        times["step_only"].append((time.perf_counter() - t0) * 1e3 / steps)

        t0 = time.perf_counter()
        for _ in range(steps):
            state, loss, _ = step(state, jax.device_put(host_batch(spec, rng)))
            jax.block_until_ready(loss)
        times["sequential"].append((time.perf_counter() - t0) * 1e3 / steps)

        pipeline = TrainPipeline(step, state, depth=depth)
        loader = (host_batch(spec, rng) for _ in range(steps))
        t0 = time.perf_counter()
        while True:
            try:
                loss, _ = pipeline.progress(loader)
            except StopIteration:
                break
        jax.block_until_ready(pipeline.state)
        times["pipelined"].append((time.perf_counter() - t0) * 1e3 / steps)
        state = pipeline.state
    out = [record("pipeline", spec, mode, t, steps=steps) for mode, t in times.items()]
    med = {r["impl"]: r["median_ms"] for r in out}
    out.append(
        {
            "bench": "pipeline",
            "impl": "ratios",
            **spec.as_dict(),
            "sequential_over_pipelined": round(med["sequential"] / med["pipelined"], 3),
            "pipelined_over_ideal": round(
                med["pipelined"] / max(med["host_prep"], med["step_only"]), 3
            ),
        }
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spec_args(p)
    p.add_argument("--steps", type=int, default=10, help="batches per timed run")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--depth", type=int, default=2, help="TrainPipeline depth")
    p.add_argument(
        "--compare-steps",
        action="store_true",
        help="time sync, sparse-dist and semi-sync pipelines on device batches",
    )
    p.add_argument("--out", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    bench = compare_steps if args.compare_steps else run
    for spec in specs_from_args(args):
        for line in bench(spec, args.steps, args.reps, args.depth):
            emit(line, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
