"""Managed collision ("zero-collision hashing") on a stream whose ids drift over time.

Real ids (users, items) are unbounded and change: new ones arrive, old ones go
quiet. This example trains a click model whose two tables are far smaller
than the id universe, behind TorchRec-style managed-collision modules
(``ManagedCollisionEmbeddingBagCollection``): every ``--interval`` steps each
module admits the ids it saw most (LFU), most recently (LRU) or both
(DistanceLFU) into free or evicted table rows; evicted rows and their
optimizer state are re-initialised in the same train step. Ids not admitted
yet share one "miss" row.

The stream: at step ``s`` users and items are drawn Zipf-like from windows of
an id universe that slide by ``--drift`` ids a step, so the popular ids of
now were unknown a few hundred steps ago. Raw ids are scattered over
``[0, 2**31)`` (a multiplicative hash of the universe index), as real ids
are. Clicks come from hidden per-user and per-item biases, so a row that
keeps serving one id can learn it.

Every ``--report-every`` steps it prints, per table, the hit rate (ids that
found a row of their own), the rows evicted, the free rows, and the mean
train loss. Run it from the repository root (about 20 s on two CPU cores)::

    python examples/zch.py
    python examples/zch.py --policy lru --drift 8
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from jaxrec.embedding import CombinedOptimizer
from jaxrec.modules import (
    EVICTION_FILL,
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
)
from jaxrec.optim import rowwise_adagrad
from jaxrec.train import init_train_state, make_train_step

POLICIES = {
    "lfu": LFU_EvictionPolicy,
    "lru": LRU_EvictionPolicy,
    "distance_lfu": DistanceLFU_EvictionPolicy,
}
TABLES = ("user", "item")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=600, help="training steps")
    p.add_argument("--batch", type=int, default=256, help="samples per step")
    p.add_argument("--zch-size", type=int, default=2048, help="rows per table (slots)")
    p.add_argument("--window", type=int, default=3000, help="ids active at any time")
    p.add_argument("--drift", type=int, default=4, help="ids the window slides per step")
    p.add_argument("--interval", type=int, default=10, help="eviction interval (steps)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="lfu", help="eviction policy")
    p.add_argument("--report-every", type=int, default=50, help="steps per printed row")
    p.add_argument("--seed", type=int, default=0, help="data and initialisation")
    return p.parse_args(argv)


class DriftingStream:
    """Zipf-like draws from a sliding window of a id universe, with hidden biases."""

    def __init__(self, args, rng: np.random.Generator):
        self.args, self.rng = args, rng
        universe = args.window + args.drift * args.steps + 1
        self.bias = {t: rng.normal(0.0, 1.0, universe).astype(np.float32) for t in TABLES}
        ranks = np.arange(1, args.window + 1)
        self.p = 1.0 / ranks**1.05
        self.p /= self.p.sum()

    def raw_id(self, index: np.ndarray) -> np.ndarray:
        """Universe index -> raw id in [0, 2**31) (a bijection: odd multiplier mod 2**31)."""
        return ((index.astype(np.uint64) * 2654435761) % (1 << 31)).astype(np.int32)

    def batch(self, step: int):
        a = self.args
        start = a.drift * step
        idx = {t: start + self.rng.choice(a.window, a.batch, p=self.p) for t in TABLES}
        logit = self.bias["user"][idx["user"]] + self.bias["item"][idx["item"]] - 0.5
        label = (self.rng.random(a.batch) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        values = np.concatenate([self.raw_id(idx[t]) for t in TABLES])
        kjt = KeyedJaggedTensor.from_lengths_sync(
            list(TABLES),
            values,
            np.ones(2 * a.batch, np.int32),
            capacities={t: a.batch for t in TABLES},
        )
        return kjt, jnp.asarray(label)


class ClickModel(nnx.Module):
    def __init__(self, args, *, rngs: nnx.Rngs):
        tables = [
            EmbeddingBagConfig(
                name=t, num_embeddings=args.zch_size, embedding_dim=16, feature_names=[t]
            )
            for t in TABLES
        ]
        modules = {
            t: MCHManagedCollisionModule(
                args.zch_size,
                eviction_policy=POLICIES[args.policy](),
                eviction_interval=args.interval,
            )
            for t in TABLES
        }
        self.mc_ebc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables, rngs=rngs),
            ManagedCollisionCollection(modules, tables),
            return_remapped_features=True,
            rngs=rngs,
        )
        self.miss_row = args.zch_size - 1
        self.mlp = nnx.Sequential(
            nnx.Linear(32, 32, rngs=rngs), nnx.relu, nnx.Linear(32, 1, rngs=rngs)
        )

    def __call__(self, kjt: KeyedJaggedTensor):
        pooled, remapped = self.mc_ebc(kjt)
        logits = self.mlp(pooled.values())[:, 0]
        b = kjt.stride()
        rows = remapped.values().reshape(len(TABLES), b)  # one id per bag, key-major
        hits = jnp.sum(rows != self.miss_row, axis=1)
        evicted = self.mc_ebc.evict()
        n_evicted = jnp.stack([jnp.sum(evicted[t] != EVICTION_FILL) for t in TABLES])
        free = self.mc_ebc.open_slots()
        n_free = jnp.stack([free[t] for t in TABLES])
        return logits, {"hits": hits, "evicted": n_evicted, "free": n_free}


def loss_fn(model, batch):
    kjt, label = batch
    logits, stats = model(kjt)
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, label)), stats


def main(argv=None) -> dict:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    stream = DriftingStream(args, rng)
    model = ClickModel(args, rngs=nnx.Rngs(args.seed))
    first = stream.batch(0)
    model.mc_ebc.ensure_buffers(first[0])  # static history buffers before splitting the model
    optimizer = CombinedOptimizer(optax.adam(3e-3), rowwise_adagrad(0.05))
    graphdef, state = init_train_state(model, optimizer)
    step = make_train_step(graphdef, optimizer, loss_fn, has_aux=True)
    print(
        f"policy={args.policy} zch_size={args.zch_size} window={args.window} "
        f"drift={args.drift}/step interval={args.interval} batch={args.batch}"
    )
    print(f"{'steps':>11} {'hit user':>8} {'hit item':>8} {'evicted':>13} {'free':>11} {'loss':>7}")
    t0, report = time.perf_counter(), []
    hits, evicted, losses = np.zeros(2), np.zeros(2, np.int64), []
    batch = first
    for s in range(args.steps):
        state, loss, stats = step(state, batch)
        hits += np.asarray(stats["hits"])
        evicted += np.asarray(stats["evicted"])
        losses.append(float(loss))
        if s + 1 < args.steps:
            batch = stream.batch(s + 1)
        if (s + 1) % args.report_every == 0 or s + 1 == args.steps:
            n = len(losses)
            free = np.asarray(stats["free"]).tolist()  # after the latest step
            rate = hits / (n * args.batch)
            row = {
                "step": s + 1,
                "hit_rate": rate.tolist(),
                "evicted": evicted.tolist(),
                "free": free,
                "loss": float(np.mean(losses)),
            }
            report.append(row)
            print(
                f"{s + 2 - n:>5}-{s + 1:<5} {rate[0]:>8.3f} {rate[1]:>8.3f} "
                f"{evicted[0]:>6} {evicted[1]:>6} {free[0]:>5} {free[1]:>5} {row['loss']:>7.4f}"
            )
            hits, evicted, losses = np.zeros(2), np.zeros(2, np.int64), []
    jax.block_until_ready(state)
    print(f"{args.steps} steps in {time.perf_counter() - t0:.1f} s")
    return {"args": vars(args), "report": report}


if __name__ == "__main__":
    main()
