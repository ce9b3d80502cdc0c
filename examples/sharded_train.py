"""TorchRec's tutorial, "Distributed Training and Sharding", rebuilt with jaxrec.

On 8 fake CPU devices (one host, no accelerator needed):

1. An ``EmbeddingBagCollection`` with the tutorial's ``product_table`` and
   ``user_table`` (4096 x 64 each).
2. A sharding plan mixing ``row_wise`` (product) and ``table_wise`` (user),
   built with ``construct_module_sharding_plan`` and printed as TorchRec
   prints one.
3. ``DistributedModelParallel`` wraps a small model (EBC + MLP head) over an
   8-device mesh; the sharded EBC's forward returns the same ``KeyedTensor``
   as the unsharded one. Given the model's constructor instead (TorchRec's
   ``meta`` device), it builds the model sharded, each device drawing only its
   own shards: the same tables, bit for bit, with no table ever whole.
4. Per-device placement: which table shards and rows each device holds, from
   the sharded module's layout and from ``jax.Array.addressable_shards``.
5. The id exchange: the fast-path capacity each width group gets from input
   statistics, and from measured loads.
6. A few training steps (``make_train_step``, Adam + fused row-wise Adagrad)
   on batches placed with ``shard_batch``, printing the loss, the ids that
   took extra exchange rounds (none is ever dropped), and the logical tables
   back from ``state_dict()``.

Run it from the repository root with jaxrec installed (``pip install -e .``);
it takes about 15 s on two CPU cores::

    python examples/sharded_train.py
"""

import argparse
import os

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

import jaxrec  # noqa: E402
from jaxrec import distributed as d  # noqa: E402
from jaxrec import optim, train  # noqa: E402
from jaxrec.embedding import CombinedOptimizer  # noqa: E402

WORLD = 8
ROWS, DIM = 4096, 64
B = 32  # samples per device
MAX_IDS = 4  # ids per bag: 1..MAX_IDS
STEPS = 10


def section(title: str) -> None:
    print(f"\n=== {title} ===")


class Model(nnx.Module):
    """Pooled product and user embeddings -> a small MLP -> one score."""

    def __init__(self, *, rngs: nnx.Rngs):
        tables = [
            jaxrec.EmbeddingBagConfig(
                name="product_table",
                embedding_dim=DIM,
                num_embeddings=ROWS,
                feature_names=["product"],
            ),
            jaxrec.EmbeddingBagConfig(
                name="user_table",
                embedding_dim=DIM,
                num_embeddings=ROWS,
                feature_names=["user"],
            ),
        ]
        self.ebc = jaxrec.EmbeddingBagCollection(tables, rngs=rngs)
        self.hidden = nnx.Linear(2 * DIM, 16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, kjt: jaxrec.KeyedJaggedTensor) -> jax.Array:
        x = self.ebc(kjt).values()  # [B, 128]: product | user
        return self.out(jax.nn.relu(self.hidden(x)))[:, 0]


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def local_batch(rng: np.random.Generator, truth: dict) -> tuple:
    """One device's batch: ``B`` bags per feature; targets from hidden per-id scores.

    Ids are Zipf-distributed (a few popular products and users), so a few
    steps see the popular rows often enough to learn them.
    """
    bags = {
        k: [(rng.zipf(1.3, rng.integers(1, MAX_IDS + 1)) - 1) % ROWS for _ in range(B)]
        for k in ("product", "user")
    }
    y = np.asarray(
        [
            np.tanh(truth["product"][p].mean() + truth["user"][u].mean())
            for p, u in zip(bags["product"], bags["user"], strict=True)
        ],
        np.float32,
    )
    kjt = jaxrec.KeyedJaggedTensor.from_lengths_sync(
        ["product", "user"],
        np.concatenate(bags["product"] + bags["user"]),
        [len(b) for b in bags["product"] + bags["user"]],
        capacities=[B * MAX_IDS, B * MAX_IDS],  # fixed: every device, every step
    )
    return kjt, y


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=STEPS, help="training steps in section 6")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    section("1. Devices and mesh")
    mesh = jax.make_mesh((WORLD,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    print(f"{len(jax.devices())} devices: {jax.devices()}")
    print(f"mesh: {dict(mesh.shape)}; rank r is mesh.devices.flat[r]")

    section("2. A sharding plan: product_table row-wise, user_table table-wise on rank 3")
    model = Model(rngs=nnx.Rngs(0))
    module_plan = d.construct_module_sharding_plan(
        model.ebc,
        {"product_table": d.row_wise(), "user_table": d.table_wise(rank=3)},
        world_size=WORLD,
    )
    plan = d.ShardingPlan({"ebc": module_plan})
    print(plan)

    section("3. DistributedModelParallel")
    rng = np.random.default_rng(0)
    truth = {k: rng.normal(0, 1, ROWS) for k in ("product", "user")}
    locals_ = [local_batch(rng, truth) for _ in range(WORLD)]
    forward = nnx.jit(lambda ebc, kjt: ebc(kjt).values())
    reference = np.asarray(forward(model.ebc, locals_[0][0]))  # unsharded, device 0's batch
    model = d.DistributedModelParallel(model, plan, mesh)
    sebc = model.ebc
    print(f"model.ebc is now a {type(sebc).__name__}")
    batch = d.shard_batch(locals_, mesh)
    values = forward(sebc, batch[0])  # the sharded EBC's KeyedTensor values
    print(
        f"output {values.shape} for {list(sebc.embedding_names)}, sharded as {values.sharding.spec}"
    )
    same = np.allclose(np.asarray(values)[:B], reference, atol=1e-6)
    print(f"device 0's rows equal the unsharded EBC on its batch: {same}")
    built = d.DistributedModelParallel(lambda: Model(rngs=nnx.Rngs(0)), plan, mesh)
    equal = all(
        np.array_equal(np.asarray(built.ebc.state_dict()[k]), np.asarray(v))
        for k, v in sebc.state_dict().items()
    )
    print(f"built from the constructor (each device draws its own shards): same tables {equal}")

    section("4. Per-device placement")
    print("From the layout (what each rank stacks in its buffer per width group):")
    for g in sebc.layout.groups:
        logical = sum(nr for shards in g.shards for _, _, nr, _, _ in shards)
        print(
            f" group {g.name}: {g.ncols} columns, {g.rows_per_rank} rows per rank "
            f"(padded to the fullest rank: {WORLD * g.rows_per_rank} rows held for "
            f"{logical} logical)"
        )
        for rank, shards in enumerate(g.shards):
            held = ", ".join(
                f"{t}[{r0}:{r0 + nr}, {c0}:{c0 + g.width(t, r0, c0)}] at local row {off}"
                for t, r0, nr, c0, off in shards
            )
            print(f"  rank {rank} ({mesh.devices.flat[rank]}): {held}")
    print("From jax.Array.addressable_shards (the global buffer of each group):")
    for name, var in sebc.weights.items():
        arr = var.get_value()
        print(f" {name}: global {arr.shape}, sharding {arr.sharding.spec}")
        for s in arr.addressable_shards:
            rows = s.index[0]
            print(f"  {s.device}: rows {rows.start}:{rows.stop} of the buffer, {s.data.shape}")

    section("5. The id exchange")
    # Without pooling factors every feature is expected to fill its capacity (4 ids a
    # bag here, 2.5 on average), spread evenly over its rows; measured loads see both
    # the real bag sizes and the popular products crowding row-wise rank 0.
    print(f"fast-path ids per destination, from capacities: {sebc.capacities(locals_[0][0])}")
    sample = [local_batch(rng, truth)[0] for _ in range(4 * WORLD)]
    measured = sebc.measure_capacities(sample)
    print(f"measured from {len(sample)} sample batches: {measured}")
    sebc.capacity = measured  # read when a step is traced: set it before the first one

    section("6. Training")
    opt = CombinedOptimizer(optax.adam(1e-2), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    for i in range(args.steps):
        batch = d.shard_batch([local_batch(rng, truth) for _ in range(WORLD)], mesh)
        state, loss, _ = step(state, batch)
        print(f"step {i}: loss {float(loss):.4f}")
    trained = train.merge_model(graphdef, state)
    beyond = int(trained.ebc.overflow_count.get_value().sum())
    print(f"ids sent in extra exchange rounds over {args.steps} steps: {beyond} (none dropped)")
    tables = trained.ebc.state_dict()  # logical tables, gathered from the shards
    for key, w in tables.items():
        print(f"{key}: {w.shape}")


if __name__ == "__main__":
    main()
