"""Table sets and independent checks shared by the planner tests."""

from __future__ import annotations

import math

import numpy as np

import jaxrec as jr
from jaxrec.distributed.types import ShardingPlan, ShardingType

GiB = 1024**3
MiB = 1024**2


def random_tables(seed: int, count: int, prefix: str = "t") -> list:
    rng = np.random.default_rng(seed)
    return [
        jr.EmbeddingBagConfig(
            name=f"{prefix}{i}",
            num_embeddings=int(rng.choice([100, 10_000, 500_000, 3_000_000])),
            embedding_dim=int(rng.choice([16, 32, 64, 128])),
            data_type=jr.DataType.FP32 if rng.random() < 0.8 else jr.DataType.FP16,
        )
        for i in range(count)
    ]


def padded_table_bytes(plan: ShardingPlan, tables, world: int, state_per_row) -> float:
    """Weights + optimizer state per device, recomputed from the plan as layout.py pads.

    ``state_per_row(ncols) -> bytes``. Independent of the planner's bookkeeping:
    per (columns, dtype) group, every device holds the fullest rank's rows;
    data-parallel tables are full replicas.
    """
    cfg = {t.name: t for t in tables}
    rows: dict[tuple, np.ndarray] = {}
    total = 0.0
    for name, ps in plan.plan[""].items():
        t = cfg[name]
        item = 2 if t.data_type is not jr.DataType.FP32 else 4
        if ps.sharding_type is ShardingType.DATA_PARALLEL:
            total += t.num_embeddings * (t.embedding_dim * item + state_per_row(t.embedding_dim))
            continue
        for s in ps.sharding_spec:
            nr, nc = s.shard_sizes
            if nr and nc:
                key = (nc, item)
                rows.setdefault(key, np.zeros(world, np.int64))[s.placement] += nr
    for (nc, item), r in rows.items():
        total += r.max() * (nc * item + state_per_row(nc))
    return total


def recount(
    tables, layout, world: int, batch: int, means, caps, calls: int = 0, weighted: bool = False
) -> dict:
    """The sharded exchange's buffers and collective bytes per device, recounted from
    ``build_layout`` (numpy and math, independent of the planner's bookkeeping).

    ``means`` / ``caps``: ``{feature: mean ids per device}`` / ``{feature: capacity}``;
    ``calls``: row sums per step of the optimizer (1 for row-wise Adagrad).
    Per width group, with ``N`` devices and ``B`` samples per device:

    - fast-path capacity ``C = fast_path_capacity(X, natural)``, ``X`` the largest
      over ranks of the sum over its slots of ``mean * shard rows / table rows``,
      ``natural`` the largest sum of the capacities its slots read; ``K = N * C``;
    - ids ``all_to_all``: ``[N, P]`` int32 sent and received, ``P = C + min(S * B, C)``
      (``+ C`` weighted);
    - per received id: float32 row gradients, sort pair, CUB scratch: ``4 * w + 16``;
    - blocks: ``3 * N * S * B * w * 4`` (send, receive, the backward's received
      gradient blocks);
    - column-split tables: ``max(K * w * 4, 2 * 4 * V)``, ``V`` the largest over ranks
      of ``calls * N * min(C, ids of t)`` summed over the split tables ``t`` on it;
      the row sums sent are the collection's own ``PeerSchedule.bytes_sent()``.

    Data-parallel tables: three gathered ``[N * ids, dim]`` float32 copies and their
    ids, masks, sort pairs and scratch.
    """
    from jaxrec.distributed.capacity import fast_path_capacity
    from jaxrec.distributed.row_sums import peer_schedule

    conf = {t.name: t for t in tables}
    owner = {f: t for t in tables for f in t.feature_names}
    ids_of = {t.name: sum(caps[f] for f in t.feature_names) for t in tables}
    out = {
        "buffers": 0.0,
        "ids_all_to_all": 0,
        "blocks": 0,
        "row_sum_values": 0,
        "row_sum_bytes": 0,
        "capacities": {},
    }
    for g in layout.groups:
        exp = [
            math.fsum(means[s.key] * s.nrows / owner[s.key].num_embeddings for s in slots)
            for slots in g.slots
        ]
        natural = max(sum(caps[s.key] for s in slots) for slots in g.slots)
        c = fast_path_capacity(max(exp), natural)
        s = max(1, max(len(x) for x in g.slots))
        p = c + min(s * batch, c) + (c if weighted else 0)
        k, w = world * c, g.ncols
        out["capacities"][g.name] = c
        out["ids_all_to_all"] += world * p * 4
        out["blocks"] += world * s * batch * w * 4
        out["buffers"] += 2 * world * p * 4 + k * (4 * w + 16) + 3 * world * s * batch * w * 4
        split = [{n for n, *_ in shards if w < conf[n].embedding_dim} for shards in g.shards]
        if any(split):
            v = max(sum(calls * world * min(c, ids_of[n]) for n in names) for names in split)
            out["buffers"] += max(k * w * 4, 2 * 4 * v)
            out["row_sum_values"] += v
            if calls:  # what the collection's ppermute rounds send, per row sum
                sizes = {t.name: min(k, world * ids_of[t.name]) for t in tables}
                sched = peer_schedule(g, layout, tables, sizes)
                out["row_sum_bytes"] += calls * sched.bytes_sent()
    for name in layout.replicated:
        t = conf[name]
        n = world * ids_of[name]
        out["buffers"] += n * (3 * t.embedding_dim * 4 + 4 + 1 + 8 + 8)
    return out
