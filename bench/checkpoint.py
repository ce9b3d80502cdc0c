"""Checkpoint bandwidth: save and restore of a multi-GB sharded state against ``np.save``.

A model of ``--tables`` tables (``--gb`` of weights and row-wise Adagrad state in
all, dim 128) sharded row-wise over 8 CPU devices. In one process it measures
(medians over ``--reps``, each into a fresh directory):

* ``save_sync``: ``CheckpointManager(async_save=False).save`` (fsync'd);
* ``save_async_return`` / ``save_async``: an async save until it returns (the
  host copy of the pieces) and until it is on disk;
* ``restore_same``: a restore into the saving plan; ``restore_other``: into a
  table-wise / column-wise plan (resharding);
* the reference, the same bytes as one host array: ``np.save`` (page cache),
  ``np.save`` + ``fsync``, and ``np.load``.

Every figure is logical bytes (weights and state, unpadded) per second. Reads
come from the page cache when the machine's memory holds the files (it does for
a few GB here), for jaxrec and the reference alike. One JSON line::

    python bench/checkpoint.py --gb 2 --out bench/results/checkpoint_cpu_2core_<date>.jsonl
    python bench/checkpoint.py --gb 1 --tables 500 ...   # many tables: many pieces
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import cpu_model, emit  # noqa: E402
from flax import nnx  # noqa: E402

import jaxrec as jr  # noqa: E402
from jaxrec import checkpoint as ckpt  # noqa: E402
from jaxrec import distributed as d  # noqa: E402
from jaxrec import optim, train  # noqa: E402
from jaxrec.embedding import CombinedOptimizer  # noqa: E402

OPT = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.1))
DIM = 128


class Model(nnx.Module):
    def __init__(self, tables: int, rows: int):
        configs = [
            jr.EmbeddingBagConfig(
                name=f"t{i}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f{i}"]
            )
            for i in range(tables)
        ]
        self.ebc = jr.EmbeddingBagCollection(configs, rngs=nnx.Rngs(0))


def build(tables: int, rows: int, gens: dict):
    model = Model(tables, rows)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    plan = d.construct_module_sharding_plan(model.ebc, gens, world_size=8)
    model = d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh)
    return train.init_train_state(model, OPT)


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=2.0, help="logical GB of tables and state")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = int(args.gb * 1e9 / (args.tables * 4 * (DIM + 1)))
    logical = args.tables * rows * 4 * (DIM + 1)
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        graphdef, state = build(
            args.tables, rows, {f"t{i}": d.row_wise() for i in range(args.tables)}
        )
        other = {
            f"t{i}": d.table_wise(i % 8) if i % 2 else d.column_wise([i % 8, (i + 3) % 8])
            for i in range(args.tables)
        }
        graphdef2, target2 = build(args.tables, rows, other)
        out = {
            "bench": "checkpoint",
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "jax_version": jax.__version__,
            "logical_bytes": logical,
            "tables": args.tables,
            "rows": rows,
            "dim": DIM,
            "devices": 8,
            "reps": args.reps,
        }
        n = iter(range(10**6))

        def save(async_save: bool, wait: bool = True):
            mgr = ckpt.CheckpointManager(f"{root}/s{next(n)}", async_save=async_save)
            mgr.save(1, graphdef, OPT, state)
            if wait:
                mgr.wait_until_finished()
            return mgr

        out["save_sync_s"] = timed(lambda: save(False), args.reps)
        returns, totals = [], []
        for _ in range(args.reps):  # one save at a time: until it returns, until on disk
            start = time.perf_counter()
            mgr = save(True, wait=False)
            returns.append(time.perf_counter() - start)
            mgr.close()
            totals.append(time.perf_counter() - start)
        out["save_async_return_s"] = statistics.median(returns)
        out["save_async_s"] = statistics.median(totals)
        mgr = ckpt.CheckpointManager(f"{root}/s0")
        restore = lambda g, t: jax.block_until_ready(mgr.restore(g, OPT, t))  # noqa: E731
        out["restore_same_s"] = timed(lambda: restore(graphdef, state), args.reps)
        out["restore_other_s"] = timed(lambda: restore(graphdef2, target2), args.reps)
        shutil.rmtree(root)
        os.makedirs(root)

        ref = np.random.default_rng(0).random(logical // 4, dtype=np.float32)

        paths = []

        def np_save(sync: bool):
            path = f"{root}/r{next(n)}.npy"
            paths.append(path)
            with open(path, "wb") as f:
                np.save(f, ref)
                if sync:
                    f.flush()
                    os.fsync(f.fileno())

        out["np_save_s"] = timed(lambda: np_save(False), args.reps)
        out["np_save_fsync_s"] = timed(lambda: np_save(True), args.reps)
        out["np_load_s"] = timed(lambda: np.load(paths[-1]), args.reps)
        for k in [k for k in out if k.endswith("_s")]:
            out[k[:-2] + "_MBps"] = round(logical / out[k] / 1e6, 1)
        out["save_sync_vs_np_save_fsync"] = round(out["np_save_fsync_s"] / out["save_sync_s"], 3)
        out["restore_same_vs_np_load"] = round(out["np_load_s"] / out["restore_same_s"], 3)
        out["restore_other_vs_np_load"] = round(out["np_load_s"] / out["restore_other_s"], 3)
        emit(out, args.out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
