"""Train with a table kept in host memory and a device cache of its hot rows.

The table ``big`` (``--rows`` rows) lives in host memory (``jaxrec.cache.HostTable``);
the device holds ``--load-factor`` of its rows. A ``TrainPipeline`` prefetches:
batch i + 1's rows are planned and gathered while step i runs. The loader does not
end, as in production: a checkpoint is saved halfway with batches prefetched, and
after ``--steps`` the pipeline stops holding some (``discard_prefetched`` loads their
rows; they are not trained on). The last checkpoint restores into the same model
with every table on the device, and both give the same predictions.

    python examples/cached_train.py                       # 2M rows, 10% cached
    python examples/cached_train.py --rows 20000 --steps 5
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxrec as jr
from jaxrec import cache, checkpoint, optim, train
from jaxrec.datasets.random import zipf_ids
from jaxrec.embedding import CombinedOptimizer


class Model(nnx.Module):
    def __init__(self, tables, *, rngs):
        self.ebc = jr.EmbeddingBagCollection(tables, rngs=rngs)
        self.head = nnx.Linear(sum(t.embedding_dim for t in tables), 1, rngs=rngs)

    def __call__(self, kjt):
        return self.head(self.ebc(kjt).values())[:, 0]


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean(optax.sigmoid_binary_cross_entropy(model(kjt), y))


def batches(rows: int, batch: int, ids_per_bag: int, seed: int = 0):
    """Host batches without end: Zipf(1.05) ids of ``big`` (hot rows scattered),
    uniform ``small``."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(rows)
    while True:
        big = perm[zipf_ids(rng, rows, batch * ids_per_bag, 1.05)]
        small = rng.integers(0, 1000, batch)
        kjt = jr.KeyedJaggedTensor(
            ["big", "small"],
            np.concatenate([big, small]).astype(np.int32),
            lengths=np.array([ids_per_bag] * batch + [1] * batch, np.int32),
            capacities=[batch * ids_per_bag, batch],
        )
        yield kjt, (big[::ids_per_bag] % 2).astype(np.float32)  # a label the ids predict


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--rows", type=int, default=2_000_000, help="rows of the host table")
    p.add_argument("--load-factor", type=float, default=0.1, help="cached fraction of rows")
    p.add_argument("--algorithm", choices=["lru", "lfu"], default="lfu", help="eviction policy")
    p.add_argument("--steps", type=int, default=50, help="training steps")
    p.add_argument("--batch-size", type=int, default=1024, help="samples per step")
    a = p.parse_args(argv)

    configs = [
        jr.EmbeddingBagConfig(name="big", num_embeddings=a.rows, embedding_dim=32),
        jr.EmbeddingBagConfig(name="small", num_embeddings=1000, embedding_dim=16),
    ]
    opt = CombinedOptimizer(optax.adam(1e-3), optim.rowwise_adagrad(0.05))
    params = {"big": cache.CacheParams(algorithm=a.algorithm, load_factor=a.load_factor)}
    model = Model(cache.cached_configs(configs, params), rngs=nnx.Rngs(0))
    graphdef, state = train.init_train_state(model, opt)
    host = cache.HostTable.create(configs[0], opt.for_table("big"))
    rc = cache.RowCache(graphdef, opt, state, {"big": host}, params)
    print(
        f"host table: {a.rows:,} rows ({host.nbytes / 2**20:.0f} MiB with its optimizer "
        f"rows), {rc.tables['big'].slots:,} cached on the device"
    )

    step = cache.CachedTrainStep(train.make_train_step(graphdef, opt, loss_fn), rc)
    pipeline = train.TrainPipeline(step, state, to_device=cache.prefetching(rc))
    it = batches(a.rows, a.batch_size, ids_per_bag=8)
    start, losses = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as d:
        mgr = checkpoint.CheckpointManager(d, async_save=False)
        for i in range(a.steps):
            losses.append(pipeline.progress(it)[0])
            if i + 1 == a.steps // 2:  # a checkpoint mid-run: the pipeline goes on after it
                rc.save(mgr, i + 1, pipeline.state)
        pipeline.close()  # the batches it prefetched are planned but not loaded:
        state = rc.discard_prefetched(pipeline.state)  # their rows loaded, not trained on
        seconds = time.perf_counter() - start
        st = rc.stats["big"]
        print(
            f"{len(losses)} steps in {seconds:.1f} s, loss {float(losses[0]):.4f} -> "
            f"{float(losses[-1]):.4f}; hit rate {st.hit_rate:.3f}, "
            f"{st.misses / max(len(losses), 1):,.0f} rows fetched a step"
        )

        # the checkpoint holds the logical tables: it restores into the all-device model
        state = rc.save(mgr, a.steps, state)
        g_full, target = train.init_train_state(Model(configs, rngs=nnx.Rngs(1)), opt)
        full = mgr.restore(g_full, opt, target)
    kjt, _ = next(batches(a.rows, a.batch_size, ids_per_bag=8, seed=1))
    state, slots = rc.load_batch(state, (kjt, None))
    cached = train.make_eval_step(graphdef, lambda m, b: m(b[0]))(state, slots)
    on_device = train.make_eval_step(g_full, lambda m, b: m(b[0]))(full, (kjt, None))
    same = bool(jax.numpy.array_equal(cached, on_device))
    print(f"restored into the all-device model: predictions equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
