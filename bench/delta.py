"""Delta checkpoints against full ones: size and time of publishing and applying the rows
changed since the last link, for a 10M-row table trained on Zipf ids.

One ``EmbeddingBagCollection`` table of ``--rows`` rows (dim ``--dim``, fp32,
row-wise Adagrad: one state value per row) and a linear head, on one CPU
device. Each step looks up ``--batch`` bags of ``--ids`` ids drawn from a Zipf
law (``--alpha``) over the rows, the ranks scattered over the table by a fixed
permutation (hot rows are not neighbours). In one process it measures:

* ``step`` line: the train step with touched-row marks (``track_touched_rows``)
  against the same step of an untracked copy of the model, on the same batches
  in alternating blocks (median step time; ``ratio`` > 1: marking costs that much);
* ``full`` line: ``CheckpointManager.save`` (synchronous, fsync'd) of the whole
  state after ``--warmup`` steps (``ModelDeltaTracker.save_base``), its bytes on
  disk, and its restore;
* one ``delta`` line per ``--every`` entry: after that many more steps (the
  first publish of a size compiles its gather: the default repeats each size),
  ``ModelDeltaTracker.publish`` (the marks read, rows gathered, written,
  fsync'd, marks cleared), its bytes on disk and rows, then
  ``ModelDeltaTracker.apply_delta`` of it on the restored chain; ratios against
  the full save / restore measured in this run, and the rows a delta holds
  against the distinct ids of its steps counted in numpy (they must be equal).

The run exits 1 unless the full checkpoint plus every delta restores the
trained state bit for bit (weights, optimizer state, dense)::

    python bench/delta.py --out bench/results/delta_cpu_<cpu>_2core_<date>.jsonl
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import cpu_model, emit  # noqa: E402
from flax import nnx  # noqa: E402

import jaxrec as jr  # noqa: E402
from jaxrec import checkpoint as ckpt  # noqa: E402
from jaxrec import optim, train  # noqa: E402
from jaxrec.embedding import CombinedOptimizer, track_touched_rows  # noqa: E402

OPT = CombinedOptimizer(optax.adam(1e-3), optim.rowwise_adagrad(0.05))


class Model(nnx.Module):
    def __init__(self, rows: int, dim: int):
        config = jr.EmbeddingBagConfig(
            name="t0", embedding_dim=dim, num_embeddings=rows, feature_names=["f0"]
        )
        self.ebc = jr.EmbeddingBagCollection([config], rngs=nnx.Rngs(0))
        self.head = nnx.Linear(dim, 1, rngs=nnx.Rngs(1))

    def __call__(self, kjt):
        return self.head(self.ebc(kjt).values())[:, 0]


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


class Batches:
    """Zipf ids over ``rows`` (ranks scattered by a fixed permutation), ``ids`` a bag."""

    def __init__(self, rows: int, batch: int, ids: int, alpha: float, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.perm = np.random.default_rng(seed + 1).permutation(rows).astype(np.int32)
        self.rows, self.batch, self.ids, self.alpha = rows, batch, ids, alpha

    def next(self):
        n = self.batch * self.ids
        ranks = (self.rng.zipf(self.alpha, n) - 1) % self.rows
        values = self.perm[ranks]
        kjt = jr.KeyedJaggedTensor.from_lengths_sync(
            ["f0"], values, np.full(self.batch, self.ids, np.int32), capacities={"f0": n}
        )
        y = jnp.asarray(self.rng.normal(size=self.batch).astype(np.float32))
        return (kjt, y), values


def du(path: str) -> int:
    return int(
        subprocess.run(
            ["du", "-sb", path], capture_output=True, text=True, check=True
        ).stdout.split()[0]
    )


def run_steps(step, state, batches):
    times = []
    for b in batches:
        start = time.perf_counter()
        state, loss, _ = step(state, b)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)
    return state, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--ids", type=int, default=8, help="ids a bag")
    p.add_argument("--alpha", type=float, default=1.1, help="Zipf exponent")
    p.add_argument("--warmup", type=int, default=20, help="steps before the full save")
    p.add_argument(
        "--every",
        default="10,10,100,100",
        help="steps before each delta (a size repeated: the second publish has "
        "its gather compiled)",
    )
    p.add_argument("--timed-steps", type=int, default=20)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    every = [int(x) for x in args.every.split(",")]
    common = {
        "bench": "delta",
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "jax_version": jax.__version__,
        "rows": args.rows,
        "dim": args.dim,
        "batch": args.batch,
        "ids_per_bag": args.ids,
        "alpha": args.alpha,
        "optimizer": "rowwise_adagrad",
    }
    data = Batches(args.rows, args.batch, args.ids, args.alpha)
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        graphdef0, plain_state = train.init_train_state(Model(args.rows, args.dim), OPT)
        plain = train.make_train_step(graphdef0, OPT, loss_fn)
        model = track_touched_rows(Model(args.rows, args.dim))
        graphdef, state = train.init_train_state(model, OPT)
        del model
        step = train.make_train_step(graphdef, OPT, loss_fn)
        timed = [data.next()[0] for _ in range(args.timed_steps)]
        plain_state, _ = run_steps(plain, plain_state, timed[:1])  # compiled
        state, _ = run_steps(step, state, timed[:1])
        plain_t, tracked_t = [], []
        for _ in range(3):  # alternating blocks: a shared machine's load hits both alike
            plain_state, a = run_steps(plain, plain_state, timed)
            state, b = run_steps(step, state, timed)
            plain_t += a
            tracked_t += b
        del plain_state
        a, b = statistics.median(plain_t), statistics.median(tracked_t)
        emit(
            {
                **common,
                "line": "step",
                "plain_s": a,
                "tracked_s": b,
                "ratio": b / a,
                "steps": len(plain_t),
            },
            args.out,
        )

        for _ in range(args.warmup):
            state, _ = run_steps(step, state, [data.next()[0]])
        tracker = ckpt.ModelDeltaTracker(ckpt.CheckpointManager(root, async_save=False))
        start = time.perf_counter()
        state = tracker.save_base(0, graphdef, OPT, state).state
        full_save = time.perf_counter() - start
        full_bytes = du(os.path.join(root, "0"))
        published = []
        for i, k in enumerate(every):
            ids = []
            for _ in range(k):
                batch, values = data.next()
                state, _ = run_steps(step, state, [batch])
                ids.append(values)
            start = time.perf_counter()
            pub = tracker.publish(i + 1, graphdef, OPT, state)
            publish_s = time.perf_counter() - start
            state = pub.state
            want = len(np.unique(np.concatenate(ids)))
            published.append((k, pub, publish_s, want))
        final = ckpt.logical_state(graphdef, OPT, state)
        final_tables = {k: dict(v) for k, v in final.tables.items()}
        final_dense = jax.tree.map(np.asarray, (final.params, final.dense_opt))
        del final, state

        _, target = train.init_train_state(track_touched_rows(Model(args.rows, args.dim)), OPT)
        start = time.perf_counter()
        restored = jax.block_until_ready(tracker.manager.restore(graphdef, OPT, target, step=0))
        full_restore = time.perf_counter() - start
        del target
        emit(
            {
                **common,
                "line": "full",
                "save_s": full_save,
                "restore_s": full_restore,
                "bytes": full_bytes,
                "warmup_steps": args.warmup,
            },
            args.out,
        )
        at = tracker.full_link(0)
        ok = True
        for k, pub, publish_s, want in published:
            start = time.perf_counter()
            restored, at = tracker.apply_delta(pub.link.step, graphdef, OPT, restored, after=at)
            jax.block_until_ready(restored)
            apply_s = time.perf_counter() - start
            delta_bytes = du(os.path.join(root, "deltas", str(pub.link.step)))
            rows = pub.rows["ebc.embedding_bags.t0"]
            ok &= rows == want
            emit(
                {
                    **common,
                    "line": "delta",
                    "steps": k,
                    "delta_rows": rows,
                    "distinct_ids": want,
                    "rows_share": rows / args.rows,
                    "bytes": delta_bytes,
                    "bytes_vs_full": delta_bytes / full_bytes,
                    "publish_s": publish_s,
                    "publish_vs_full_save": publish_s / full_save,
                    "apply_s": apply_s,
                    "apply_vs_full_restore": apply_s / full_restore,
                },
                args.out,
            )
        got = ckpt.logical_state(graphdef, OPT, restored)
        for key, fields in final_tables.items():
            for f, x in fields.items():
                ok &= bool(np.array_equal(np.asarray(got.tables[key][f]), np.asarray(x)))
        dense = jax.tree.map(np.asarray, (got.params, got.dense_opt))
        ok &= all(
            np.array_equal(x, y)
            for x, y in zip(jax.tree.leaves(dense), jax.tree.leaves(final_dense), strict=True)
        )
        emit({**common, "line": "check", "bitwise_equal": bool(ok)}, args.out)
        if not ok:
            sys.exit(1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
