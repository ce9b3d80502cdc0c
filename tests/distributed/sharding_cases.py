"""Tables, batches and a small model shared by the sharding tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxrec as jr
from jaxrec import distributed as d

KEYS = ["f1", "f2", "f3", "f4"]
ROWS = {"f1": 10, "f2": 50, "f3": 37, "f4": 20}
B = 4  # per device
CAP = 16  # per key per device


def tables():
    """Uneven sizes on purpose: 50 rows over 8 ranks, 6 columns over 4, a shared table."""
    return [
        jr.EmbeddingBagConfig(
            name="t1", embedding_dim=8, num_embeddings=50, feature_names=["f1", "f2"]
        ),
        jr.EmbeddingBagConfig(
            name="t2",
            embedding_dim=6,
            num_embeddings=37,
            feature_names=["f3"],
            pooling=jr.PoolingType.MEAN,
        ),
        jr.EmbeddingBagConfig(name="t3", embedding_dim=8, num_embeddings=20, feature_names=["f4"]),
        jr.EmbeddingBagConfig(name="t4", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
    ]


def mesh_1d():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def mesh_2d():
    return jax.make_mesh((2, 4), ("host", "local"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


class Model(nnx.Module):
    def __init__(self, weighted=False, *, rngs):
        self.ebc = jr.EmbeddingBagCollection(tables(), weighted, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(34, 1, rngs=rngs)

    def __call__(self, kjt):
        return jnp.tanh(self.head(self.ebc(kjt).values())[:, 0])


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def batches(rng, world=8, weighted=False, empty_key_on=(2,)):
    """One local batch per device and the same data as one global batch.

    Devices in ``empty_key_on`` have no ids at all for ``f3``. The global batch has
    one capacity per key (the locals' together), not the bucket its ids fall in: every
    global batch has one shape, so an unsharded reference step compiles once.
    """
    local, all_bags, all_w, ys = [], {k: [] for k in KEYS}, {k: [] for k in KEYS}, []
    for dev in range(world):
        bags = {}
        for k in KEYS:
            bags[k] = [
                []
                if (k == "f3" and dev in empty_key_on) or rng.random() < 0.2
                else rng.integers(0, ROWS[k], int(rng.integers(1, 5))).tolist()
                for _ in range(B)
            ]
            bags[k][1] = bags[k][1] + bags[k][1][:1]  # a duplicate id
        ws = {k: [rng.uniform(0.5, 2, len(b)).tolist() for b in bags[k]] for k in KEYS}
        for k in KEYS:
            all_bags[k] += bags[k]
            all_w[k] += ws[k]
        y = rng.normal(size=B).astype(np.float32)
        ys.append(y)
        local.append((_kjt(bags, ws if weighted else None, {k: CAP for k in KEYS}), y))
    caps = {k: world * CAP for k in KEYS}
    glob = (_kjt(all_bags, all_w if weighted else None, caps), jnp.asarray(np.concatenate(ys)))
    return local, glob


def _kjt(bags, ws, caps):
    lengths = [len(b) for k in KEYS for b in bags[k]]
    values = [i for k in KEYS for b in bags[k] for i in b]
    w = None if ws is None else np.asarray([x for k in KEYS for b in ws[k] for x in b], np.float32)
    return jr.KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths, weights=w, capacities=caps)


def uneven_columns(widths, ranks=None, hosts=None):
    """Column blocks of ``widths`` (any sizes: the builders cut ceil-sized ones), one per
    rank of ``ranks``, or (``hosts``) one per host, its rows split over the host's ranks."""

    def gen(t, world_size, local_size):
        c0s = np.cumsum([0, *widths[:-1]]).tolist()
        if hosts is None:
            kind, blocks = d.ShardingType.COLUMN_WISE, [(0, t.num_embeddings, r) for r in ranks]
        else:
            kind, size = d.ShardingType.GRID_SHARD, -(-t.num_embeddings // local_size)
            blocks = [
                [
                    (i * size, min(size, t.num_embeddings - i * size), h * local_size + i)
                    for i in range(local_size)
                    if i * size < t.num_embeddings
                ]
                for h in hosts
            ]
        per_col = [[b] for b in blocks] if hosts is None else blocks
        spec = tuple(
            d.ShardMetadata(shard_offsets=(r0, c0), shard_sizes=(nr, w), placement=rank)
            for c0, w, col in zip(c0s, widths, per_col, strict=True)
            for r0, nr, rank in col
        )
        return d.ParameterSharding(
            sharding_type=kind,
            compute_kernel=d.EmbeddingComputeKernel.FUSED,
            ranks=tuple(sorted({x.placement for x in spec})),
            sharding_spec=spec,
        )

    return gen


# Column splits are uneven on purpose (tables keep every column block in one
# zero-padded buffer, so row-wise optimizers stay exact): 8 columns over 3
# ranks (3, 3, 2), and hand-made blocks (a narrow first or last block).
PLANS = {
    "table_wise": (
        {
            "t1": d.table_wise(1),
            "t2": d.table_wise(7),
            "t3": d.table_wise(1),
            "t4": d.table_wise(4),
        },
        1,
    ),
    "row_wise": (
        {"t1": d.row_wise(), "t2": d.row_wise(), "t3": d.row_wise([2, 5]), "t4": d.row_wise()},
        1,
    ),
    "column_wise": (
        {
            "t1": d.column_wise([0, 3, 5]),
            "t2": d.column_wise([1, 5, 6, 2]),
            "t3": d.column_wise([7]),
            "t4": uneven_columns([1, 3], ranks=[4, 0]),
        },
        1,
    ),
    "data_parallel": ({t: d.data_parallel() for t in ("t1", "t2", "t3", "t4")}, 1),
    "mixed": (
        {
            "t1": d.row_wise(),
            "t2": d.table_wise(3),
            "t3": d.column_wise([6, 1, 3]),
            "t4": d.data_parallel(),
        },
        1,
    ),
    "table_row_wise": (
        {
            "t1": d.table_row_wise(0),
            "t2": d.table_row_wise(1),
            "t3": d.table_row_wise(1),
            "t4": d.table_row_wise(0),
        },
        2,
    ),
    "table_column_wise": (
        {
            "t1": d.table_column_wise(1),
            "t2": d.table_column_wise(0),
            "t3": d.table_column_wise(0, 3),
            "t4": d.table_column_wise(1),
        },
        2,
    ),
    "grid_shard": (
        {
            "t1": d.grid_shard([0, 1]),
            "t2": d.grid_shard([1, 0]),
            "t3": d.table_wise(2),
            "t4": uneven_columns([3, 1], hosts=[0, 1]),
        },
        2,
    ),
}
