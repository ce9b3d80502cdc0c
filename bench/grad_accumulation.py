"""Gradient-accumulation benchmark: k micro-batches in one accumulated step vs one plain step.

A DLRM (``--tables`` tables of ``--rows`` rows in all, dim ``--dim``, Zipf
``--alpha`` ids, 1..``--max-len`` ids a bag; row-wise Adagrad tables, Adam
MLPs) trains on a global batch of ``--batch`` samples:

* ``plain`` (the reference): ``jaxrec.train.make_train_step`` on the whole batch;
* ``accumulate_k<k>``: ``make_accumulating_train_step(micro_batches=k)`` on the
  same samples as ``k`` micro-batches of ``batch / k`` (one update).

Each line has the median step time, ``samples_per_s``, ``ratio`` (median over
``plain``'s: > 1 slower) and the compiled program's ``temp_bytes`` (XLA's
``memory_analysis``: activations and other scratch, not the donated state) and
``temp_ratio`` (over ``plain``'s).
Before timing, one step of each from the same state must equal the plain
step's tables and dense params (within float32 tolerance); the run exits 1 if
not.

Run from the repository root (``PYTHONPATH=.`` or jaxrec installed)::

    python bench/grad_accumulation.py --rows 100000 --batch 512 --reps 2   # quick
    python bench/grad_accumulation.py --out bench/results/grad_accumulation_cpu_<cpu>.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import emit, machine
from flax import nnx

import jaxrec as jr
from jaxrec import models, optim, train
from jaxrec.embedding import CombinedOptimizer

BENCH = "grad_accumulation"


def build(args):
    per = args.rows // args.tables
    tables = [
        jr.EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=args.dim, num_embeddings=per, feature_names=[f"f{i}"]
        )
        for i in range(args.tables)
    ]
    ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
    dense_arch = [*map(int, args.dense_arch.split(",")), args.dim]
    over_arch = [*map(int, args.over_arch.split(",")), 1]
    model = models.DLRM(ebc, args.dense_in, dense_arch, over_arch, rngs=nnx.Rngs(1))
    opt = CombinedOptimizer(optax.adam(1e-3), optim.rowwise_adagrad(0.05))
    return model, opt, per


def loss_fn(model, batch):
    dense, kjt, y = batch
    return jnp.mean(optax.sigmoid_binary_cross_entropy(model(dense, kjt)[:, 0], y))


def make_batch(rng, args, rows, n):
    """``(dense [n, dense_in], kjt, labels [n])``: bag lengths 1..max_len, Zipf ids."""
    keys = [f"f{i}" for i in range(args.tables)]
    lengths = rng.integers(1, args.max_len + 1, (args.tables, n))
    ids = (rng.zipf(args.alpha, int(lengths.sum())) - 1) % rows
    kjt = jr.KeyedJaggedTensor.from_lengths_sync(
        keys, ids, lengths.reshape(-1), capacities={k: n * args.max_len for k in keys}
    )
    dense = rng.normal(size=(n, args.dense_in)).astype(np.float32)
    y = (rng.random(n) < 0.25).astype(np.float32)
    return dense, kjt, y


def split(batch, k, args):
    """The global batch as ``k`` micro-batches (bags in order)."""
    dense, kjt, y = batch
    n = y.shape[0] // k
    out = []
    for i in range(k):
        parts = []
        for key in kjt.keys():
            jt = kjt[key]
            lens = np.asarray(jt.lengths())
            offs = np.concatenate([[0], np.cumsum(lens)])
            parts.append(
                (
                    lens[i * n : (i + 1) * n],
                    np.asarray(jt.values())[offs[i * n] : offs[(i + 1) * n]],
                )
            )
        micro = jr.KeyedJaggedTensor.from_lengths_sync(
            kjt.keys(),
            np.concatenate([v for _, v in parts]),
            np.concatenate([ln for ln, _ in parts]),
            capacities={key: n * args.max_len for key in kjt.keys()},
        )
        out.append((dense[i * n : (i + 1) * n], micro, y[i * n : (i + 1) * n]))
    return out


def tables_of(state):
    return [np.asarray(x) for x in jax.tree.leaves(state.tables)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000, help="rows of all tables together")
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=4096, help="global batch (samples per step)")
    p.add_argument("--ks", default="2,4,8", help="micro-batch counts")
    p.add_argument("--max-len", type=int, default=8, help="ids per bag: 1..max_len")
    p.add_argument("--alpha", type=float, default=1.1, help="Zipf exponent of the ids")
    p.add_argument("--dense-in", type=int, default=13)
    p.add_argument("--dense-arch", default="512,256", help="hidden sizes (then --dim)")
    p.add_argument("--over-arch", default="1024,1024,512", help="hidden sizes (then 1)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", help="append the JSON lines to this file")
    args = p.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    rng = np.random.default_rng(0)
    model, opt, per = build(args)
    graphdef, state = train.init_train_state(model, opt)
    del model
    glob = make_batch(rng, args, per, args.batch)
    common = {
        "bench": BENCH,
        "rows": args.rows,
        "tables": args.tables,
        "dim": args.dim,
        "batch": args.batch,
        "alpha": args.alpha,
        "max_len": args.max_len,
        "dense_arch": args.dense_arch,
        "over_arch": args.over_arch,
        "platform": jax.devices()[0].platform,
        "jax_version": jax.__version__,
        "machine": machine(),
    }

    steps = {"plain": (train.make_train_step(graphdef, opt, loss_fn), glob)}
    for k in ks:
        if args.batch % k:
            raise SystemExit(f"--batch {args.batch} is not a multiple of k={k}")
        step = train.make_accumulating_train_step(graphdef, opt, loss_fn, micro_batches=k)
        steps[f"accumulate_k{k}"] = (step, train.stack_micro_batches(split(glob, k, args)))
    glob_dev = jax.device_put(glob)

    # correctness: one step of each from the same state equals the plain step
    host0 = jax.tree.map(np.asarray, state)
    want = None
    ok = True
    for name, (step, batch) in steps.items():
        got, _, _ = step(jax.tree.map(jnp.asarray, host0), jax.device_put(batch))
        t = tables_of(got)
        if want is None:
            want = t
            continue
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(t, want, strict=True))
        if diff > 1e-4:
            print(f"{name}: tables differ from the plain step by {diff:.3g}", file=sys.stderr)
            ok = False
        del got
    del host0

    results, temps = {}, {}
    for name, (step, batch) in steps.items():
        batch = glob_dev if name == "plain" else jax.device_put(batch)
        temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
        times = []
        for i in range(args.warmup + args.reps):
            t0 = time.perf_counter()
            state, loss, _ = step(state, batch)
            jax.block_until_ready(loss)
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        med = statistics.median(times)
        results[name], temps[name] = med, temp
        k = 1 if name == "plain" else int(name.removeprefix("accumulate_k"))
        emit(
            {
                **common,
                "impl": name,
                "micro_batches": k,
                "micro_batch": args.batch // k,
                "reps": len(times),
                "median_ms": round(med, 3),
                "min_ms": round(min(times), 3),
                "samples_per_s": round(args.batch / med * 1e3, 1),
                "ratio": round(med / results["plain"], 3),
                "temp_bytes": int(temp),
                "temp_ratio": round(temp / temps["plain"], 3),
            },
            args.out,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
