"""Variable batch per key (VBE): a user feature looked up once per user, not per sample.

A batch of ``B`` samples per device holds about ``B / dup`` distinct users; the
user features repeat per sample. The same train step (row-wise sharded EBC,
row-wise Adagrad, 8 devices) runs on the plain batch and on its VBE twin
(``jaxrec.sparse.dedup_features``: one bag per user, ``inverse_indices`` to
expand), and this prints one JSON line per mode: valid ids per device, the
bytes of every all-to-all of the compiled step (ids out, pooled blocks back,
their gradients), the step time, and the ratios VBE / plain measured in the
same run. Both modes train the same model from the same state on the same
samples (their losses are printed: they agree).

    python bench/vbe.py                    # 8 CPU devices
    python bench/vbe.py --gpu 1x1x8        # the step compiled for 8 H100s (deviceless): its
                                           # all-to-all bytes of its HLO
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import emit, machine  # noqa: E402
from flax import nnx  # noqa: E402
from sharded import hlo_collectives  # noqa: E402

import jaxrec as jr  # noqa: E402
from jaxrec import distributed as d  # noqa: E402
from jaxrec import optim, train  # noqa: E402
from jaxrec.embedding import CombinedOptimizer  # noqa: E402
from jaxrec.sparse import dedup_features  # noqa: E402

# (feature, rows, dim, mean ids per bag, per user?)
FEATURES = (
    ("user_history", 10_000_000, 32, 20, True),
    ("user_profile", 1_000_000, 32, 4, True),
    ("item", 2_000_000, 32, 1, False),
    ("item_context", 1_000_000, 32, 4, False),
)
USER_KEYS = [f for f, *_, user in FEATURES if user]


def tables():
    return [
        jr.EmbeddingBagConfig(
            name=f"t_{f}", num_embeddings=rows, embedding_dim=dim, feature_names=[f]
        )
        for f, rows, dim, _, _ in FEATURES
    ]


class Model(nnx.Module):
    def __init__(self, *, rngs):
        self.ebc = jr.EmbeddingBagCollection(tables(), rngs=nnx.Rngs(0))
        self.head = nnx.Linear(sum(f[2] for f in FEATURES), 1, rngs=rngs)

    def __call__(self, kjt):
        return self.head(self.ebc(kjt).values())[:, 0]


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def local_batch(rng, batch: int, dup: int, users_cap: int):
    """One device's plain batch, its VBE twin and labels (Zipf ids, ``batch / dup`` users)."""
    users = max(1, batch // dup)
    user_of = rng.integers(0, users, batch)
    bags = {}
    for f, rows, _, pf, per_user in FEATURES:
        n = users if per_user else batch
        drawn = [np.minimum(rng.zipf(1.1, rng.poisson(pf)), rows) - 1 for _ in range(n)]
        bags[f] = [drawn[u] for u in user_of] if per_user else drawn
    keys = [f for f, *_ in FEATURES]
    lengths = [len(b) for k in keys for b in bags[k]]
    values = np.concatenate([np.concatenate(bags[k]) for k in keys]).astype(np.int32)
    caps = {f: 2 * batch * pf + 64 for f, _, _, pf, _ in FEATURES}  # one shape per batch
    plain = jr.KeyedJaggedTensor.from_lengths_sync(
        keys, values, lengths, capacities=caps, on_host=True
    )
    vbe_caps = {
        f: 2 * users_cap * pf + 64 if f in USER_KEYS else caps[f] for f, _, _, pf, _ in FEATURES
    }
    vbe = dedup_features(
        plain,
        {k: user_of for k in USER_KEYS},
        stride_per_key={k: users_cap for k in USER_KEYS},
        capacities=vbe_caps,
    )
    return plain, vbe, rng.normal(size=batch).astype(np.float32)


def all_to_all_bytes(hlo: str) -> int:
    """Operand bytes of every all-to-all of the step's fast path (what each device sends;
    ``bench/sharded.py``'s parser, which reads XLA:CPU's synchronous ops and XLA:GPU's
    async ``all-to-all-start``). The overflow path's rounds (inside loops) are left out."""
    ops = hlo_collectives(hlo)
    return sum(o["bytes"] for o in ops if o["op"] == "all-to-all" and not o.get("in_loop"))


def plan_for(model, world: int):
    gens = {t.name: d.row_wise() for t in model.ebc.table_configs}
    return d.ShardingPlan(
        {"ebc": d.construct_module_sharding_plan(model.ebc, gens, world_size=world)}
    )


def run_cpu(args) -> None:
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    opt = CombinedOptimizer(optax.adam(1e-3), optim.rowwise_adagrad(0.05))
    rng = np.random.default_rng(args.seed)
    users_cap = -(-args.batch // args.dup) + 8
    steps = [
        [local_batch(rng, args.batch, args.dup, users_cap) for _ in range(8)]
        for _ in range(args.steps + 1)
    ]
    base = None
    for mode in ("plain", "vbe"):
        m = Model(rngs=nnx.Rngs(1))
        model = d.DistributedModelParallel(m, plan_for(m, 8), mesh)
        pick = 0 if mode == "plain" else 1
        # The exchange's fast path sized from these batches (Zipf ids load rank 0 of a
        # row-wise table most): one round, as a tuned run would have.
        model.ebc.capacity = model.ebc.measure_capacities([b[pick] for s in steps for b in s])
        graphdef, state = train.init_train_state(model, opt)
        step = train.make_train_step(graphdef, opt, loss_fn)  # donated: tables update in place
        batches = [
            (d.shard_batch([b[pick] for b in s], mesh), d.shard_batch([b[2] for b in s], mesh))
            for s in steps
        ]
        compiled = step.jitted.lower(state, batches[0]).compile()
        sent = all_to_all_bytes(compiled.as_text())
        ids = float(
            np.mean(
                [
                    int(np.sum(np.asarray(b[pick].segment_ids()) < b[pick].bag_offsets()[-1]))
                    for s in steps
                    for b in s
                ]
            )
        )
        state, loss, _ = step(state, batches[0])  # warm-up (compile)
        jax.block_until_ready(loss)
        times, losses = [], [float(loss)]
        for batch in batches[1:]:
            t0 = time.perf_counter()
            state, loss, _ = step(state, batch)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        rec = {
            "bench": "vbe",
            "mode": mode,
            "devices": 8,
            "batch_per_device": args.batch,
            "duplication": args.dup,
            "user_bags_per_device": users_cap,
            "features": [list(f) for f in FEATURES],
            "sharding": "row_wise",
            "ids_per_device": ids,
            "all_to_all_bytes_per_device": sent,
            "capacities": model.ebc.capacity,
            "step_ms_median": 1e3 * float(np.median(times)),
            "steps_timed": len(times),
            "losses": losses,
            "machine": machine(),
            "jax_version": jax.__version__,
            "date": datetime.date.today().isoformat(),
        }
        if base is None:
            base = rec
        else:
            rec["vbe_over_plain"] = {
                k: round(rec[k] / base[k], 4)
                for k in ("ids_per_device", "all_to_all_bytes_per_device", "step_ms_median")
            }
            rec["max_loss_difference"] = float(np.max(np.abs(np.subtract(losses, base["losses"]))))
        emit(rec, args.out)


def run_gpu(args) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
    import deviceless_step as ds

    mesh = ds.gpu_mesh(args.gpu)
    opt = CombinedOptimizer(optax.adam(1e-3), optim.rowwise_adagrad(0.05))
    rng = np.random.default_rng(args.seed)
    users_cap = -(-args.batch // args.dup) + 8
    plain, vbe, y = local_batch(rng, args.batch, args.dup, users_cap)
    base = None
    for mode, kjt in (("plain", plain), ("vbe", vbe)):

        def build():
            m = Model(rngs=nnx.Rngs(1))
            return d.DistributedModelParallel(m, plan_for(m, mesh.size), mesh)

        compiled, _ = ds.compile_train_step(build, opt, loss_fn, (kjt, y), mesh)
        sent = all_to_all_bytes(compiled.as_text())
        if not sent:
            raise RuntimeError("found no all-to-all in the H100 program's HLO text")
        rec = {
            "bench": "vbe_deviceless",
            "mode": mode,
            "target": ds.TARGET,
            "topology": args.gpu,
            "batch_per_device": args.batch,
            "duplication": args.dup,
            "all_to_all_bytes_per_device": sent,
            "machine": machine(),
            "jax_version": jax.__version__,
            "date": datetime.date.today().isoformat(),
        }
        if base is None:
            base = rec
        else:
            rec["vbe_over_plain_bytes"] = round(sent / base["all_to_all_bytes_per_device"], 4)
        emit(rec, args.out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1024, help="samples per device")
    p.add_argument("--dup", type=int, default=10, help="samples per user")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu", default=None, help="compile for H100s deviceless, e.g. 1x1x8")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    if args.gpu:
        run_gpu(args)
    else:
        run_cpu(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
