"""A two-tower model on dynamic tables: 64-bit ids that drift, 8 devices, then 4.

Users and items carry 64-bit ids (high words set) drawn Zipf-like from windows
of an id universe that slide every step, so new ids arrive and old ones retire.
Each tower's table is a dynamic table (``HashZchManagedCollisionModule``):
rows keyed by the raw id through a hash index on the devices, new ids admitted
on their second sighting (``FrequencyAdmission``), LRU eviction when a bucket is
full, evicted rows and their optimizer state reset in the train step.

The model is sharded over 8 fake CPU devices by ``DistributedModelParallel``:
each table row-wise, each id's slot on the device its hash names (no device
sees the whole batch). Midway a checkpoint is taken and restored on 4 devices,
and training goes on there. Beside it, the same model trains unsharded on one
device on the same global batches: the reference. Every ``--report-every``
steps it prints the loss of both (they agree to float rounding), and per table
the occupancy, the ids admitted / evicted / rejected by the last step and the
hit rate (ids that found their row). Run it from the repository root (about a
minute on two CPU cores)::

    python examples/dynamic_tables.py
"""

import argparse
import os
import tempfile
import time

# 8 fake CPU devices; both must happen before JAX starts its backend.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxrec as jr  # noqa: E402
from jaxrec import checkpoint, distributed, optim, train  # noqa: E402
from jaxrec.embedding import CombinedOptimizer  # noqa: E402
from jaxrec.models import TwoTower  # noqa: E402
from jaxrec.modules import (  # noqa: E402
    FrequencyAdmission,
    HashZchManagedCollisionModule,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
)
from jaxrec.sparse import to_id_words  # noqa: E402

KEYS = ("user", "item")
BASE = {"user": 0x0123_4567_0000_0000, "item": 0x7FFF_0000_0000_0000}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=60, help="training steps in all")
    p.add_argument("--checkpoint-at", type=int, default=30, help="8 -> 4 devices after it")
    p.add_argument("--batch", type=int, default=256, help="global batch (samples a step)")
    p.add_argument("--slots", type=int, default=1024, help="rows of each dynamic table")
    p.add_argument("--window", type=int, default=3000, help="live ids of each kind")
    p.add_argument("--drift", type=int, default=40, help="ids the window slides a step")
    p.add_argument("--report-every", type=int, default=10, help="steps between reports")
    return p.parse_args(argv)


def model_fn(args):
    tables = [
        jr.EmbeddingBagConfig(
            name=f"t_{k}", embedding_dim=16, num_embeddings=args.slots, feature_names=[k]
        )
        for k in KEYS
    ]
    index = {
        t.name: HashZchManagedCollisionModule(
            args.slots,
            ways=16,
            admission=FrequencyAdmission(threshold=2),
            input_hash_seed=i,
            max_evictions=args.batch,  # a step's ids of the table: no eviction is ever dropped
        )
        for i, t in enumerate(tables)
    }
    ebc = jr.EmbeddingBagCollection(
        tables, rngs=nnx.Rngs(0), bounds_check_mode=jr.BoundsCheckMode.IGNORE
    )
    sparse = ManagedCollisionEmbeddingBagCollection(
        ebc, ManagedCollisionCollection(index, tables), rngs=nnx.Rngs(1)
    )
    return TwoTower(sparse, [32, 16], rngs=nnx.Rngs(2))


def loss_fn(model, batch):
    kjt, labels = batch
    query, candidate = model(kjt)
    return optax.sigmoid_binary_cross_entropy(jnp.sum(query * candidate, -1), labels).mean()


OPT = CombinedOptimizer(optax.adam(1e-3), optim.rowwise_adagrad(0.05))


def draw(rng, step, args):
    """One global batch: per key 64-bit ids, and click labels from hidden biases."""
    ids, ranks = {}, {}
    for k in KEYS:
        r = np.minimum(rng.zipf(1.2, args.batch) - 1, args.window - 1)
        ranks[k] = step * args.drift + r  # the id's place in its universe
        ids[k] = np.uint64(BASE[k]) + ranks[k].astype(np.uint64) * np.uint64(2**32 + 977)
    bias = np.sin(ranks["user"] * 0.7) + np.cos(ranks["item"] * 1.3)
    labels = (rng.random(args.batch) < 1 / (1 + np.exp(-2 * bias))).astype(np.float32)
    return ids, labels


def kjt(ids, lo, hi):
    values = np.concatenate([to_id_words(ids[k][lo:hi]) for k in KEYS])
    return jr.KeyedJaggedTensor.from_lengths_sync(
        list(KEYS), jnp.asarray(values), np.ones(2 * (hi - lo), np.int32)
    )


def local_batches(ids, labels, world):
    per = len(labels) // world
    return [
        (kjt(ids, i * per, (i + 1) * per), labels[i * per : (i + 1) * per]) for i in range(world)
    ]


def sharded(args, mesh):
    model = model_fn(args)
    inner = model.ebc.embedding_bag_collection
    plan = distributed.construct_module_sharding_plan(
        inner, {f"t_{k}": distributed.row_wise() for k in KEYS}, world_size=mesh.size
    )
    model = distributed.DistributedModelParallel(
        model, distributed.ShardingPlan({"ebc": plan}), mesh
    )
    return model


def counters(graphdef, state):
    mcc = train.merge_model(graphdef, state).ebc.managed_collision_collection
    return {
        t: {k: int(np.asarray(v).sum()) for k, v in c.items()} for t, c in mcc.counters().items()
    }


def main(argv=None):
    args = parse_args(argv)
    devices = jax.devices()
    mesh8 = jax.sharding.Mesh(np.array(devices[:8]), ("x",))
    mesh4 = jax.sharding.Mesh(np.array(devices[:4]), ("x",))
    ref_model = model_fn(args)
    ref_graph, ref_state = train.init_train_state(ref_model, OPT)
    ref_step = train.make_train_step(ref_graph, OPT, loss_fn)
    model = sharded(args, mesh8)
    graph, state = train.init_train_state(model, OPT)
    step = train.make_train_step(graph, OPT, loss_fn)
    world, mesh, rng, report, t0 = 8, mesh8, np.random.default_rng(1), [], time.perf_counter()
    with tempfile.TemporaryDirectory() as ckpt_dir:
        for s in range(args.steps):
            ids, labels = draw(rng, s, args)
            state, loss, _ = step(
                state, distributed.shard_batch(local_batches(ids, labels, world), mesh)
            )
            ref_state, ref_loss, _ = ref_step(
                ref_state, (kjt(ids, 0, args.batch), jnp.asarray(labels))
            )
            if (s + 1) % args.report_every == 0:
                c = counters(graph, state)
                want = counters(ref_graph, ref_state)
                line = {
                    "step": s + 1,
                    "devices": world,
                    "loss": float(loss),
                    "reference_loss": float(ref_loss),
                    "tables": c,
                    "same_index_counters": c == want,
                }
                report.append(line)
                occ = ", ".join(
                    f"{t} occupancy {v['occupancy']}/{args.slots} +{v['admitted']} "
                    f"-{v['evicted']} rejected {v['rejected']}"
                    for t, v in c.items()
                )
                print(
                    f"step {s + 1:3d} on {world} devices: loss {float(loss):.5f} "
                    f"(unsharded {float(ref_loss):.5f}); {occ}"
                )
            if s + 1 == args.checkpoint_at:  # save on 8 devices, go on with 4
                with checkpoint.CheckpointManager(ckpt_dir, async_save=False) as mgr:
                    mgr.save(s + 1, graph, OPT, state)
                model = sharded(args, mesh4)
                graph, target = train.init_train_state(model, OPT)
                step = train.make_train_step(graph, OPT, loss_fn)
                with checkpoint.CheckpointManager(ckpt_dir) as mgr:
                    state = mgr.restore(graph, OPT, target)
                world, mesh = 4, mesh4
                print(f"step {s + 1}: checkpoint on 8 devices restored on 4")
    diff = max(abs(r["loss"] - r["reference_loss"]) for r in report)
    print(
        f"{args.steps} steps in {time.perf_counter() - t0:.1f} s; largest loss difference "
        f"from the unsharded reference {diff:.2e}"
    )
    return {"report": report, "max_loss_difference": diff}


if __name__ == "__main__":
    main()
