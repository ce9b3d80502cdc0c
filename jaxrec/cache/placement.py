"""Where a cached table's slots and host rows lie: the model's cached tables, their row
shards, and the logical rows whose slots are on this process's devices."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from flax import nnx

from ..checkpoint.layout import Buffer, table_buffers
from ..checkpoint.paths import table_key
from ..configs import BaseEmbeddingConfig
from ..embedding.collection import embedding_collections
from ..embedding.optimizer import CombinedOptimizer
from ..train.step import TrainState, merge_model
from . import owned
from .mover import columns


def find_tables(
    graphdef: nnx.GraphDef, state: TrainState, names: Collection[str]
) -> tuple[dict[str, tuple[str, BaseEmbeddingConfig]], dict[str, list[str]]]:
    """``({table: (checkpoint key, device config)}, {feature: [tables reading it]})`` for
    the cached tables ``names``."""
    found: dict[str, tuple[str, BaseEmbeddingConfig]] = {}
    readers: dict[str, list[str]] = {}
    for path, module in embedding_collections(merge_model(graphdef, state)):
        for t in module.table_configs:
            for f in tuple(t.feature_names) or (t.name,):
                readers.setdefault(f, []).append(t.name)
            if t.name in names:
                if t.name in found:
                    raise ValueError(f"two collections have a table named {t.name!r}")
                found[t.name] = (table_key(path, module, t.name), t)
    missing = sorted(set(names) - set(found))
    if missing:
        raise ValueError(f"host_tables names tables the model does not have: {missing}")
    return found, readers


def slot_shards(
    weights: Sequence[Buffer], key: str, device: BaseEmbeddingConfig
) -> tuple[int, int]:
    """``(row shards, slots per shard)`` of a cached table's device table."""
    blocks = [c for b in weights for c in columns(b.blocks, key)]
    n_shards = len(set(int(r) for c in blocks[:1] for r in c.rows))
    return n_shards, device.num_embeddings // n_shards


def held_rows(
    weights: Iterable[Buffer], key: str, slots: int, shard_rows: int, rows: int
) -> tuple[int, int]:
    """The logical rows whose slots lie on this process's devices: ``(lo, hi)``. A row
    shard must lie in one process: its host rows are written back from one."""
    shards: set[int] = set()
    elsewhere: set[int] = set()
    for lane, first, end in owned.shard_lanes(weights, key, slots):
        (shards if lane.local else elsewhere).update(range(first, end))
    if shards & elsewhere:
        raise ValueError(
            f"table {key!r}: row shards {sorted(shards & elsewhere)} have slots on devices of "
            "this process and of another (column pieces or replicas across processes); a "
            "cached table's row shard must lie within one process: place its column pieces "
            "on one process's devices"
        )
    if not shards:
        return 0, 0
    lo, hi = min(shards), max(shards) + 1
    if len(shards) != hi - lo:
        raise ValueError(
            f"table {key!r}: this process's devices hold row shards {sorted(shards)}, not a "
            "range: give each process's devices consecutive ranks"
        )
    return lo * shard_rows, min(rows, hi * shard_rows)


def host_rows(
    graphdef: nnx.GraphDef,
    optimizer: CombinedOptimizer,
    state: TrainState,
    config: BaseEmbeddingConfig,
) -> tuple[int, int]:
    """The logical rows ``(lo, hi)`` of cached table ``config`` (its logical config)
    whose slots lie on this process's devices: what its ``HostTable`` holds here
    (``HostTable.create(config, optimizer, rows=host_rows(...))``); all rows in one
    process."""
    found, _ = find_tables(graphdef, state, [config.name])
    key, device = found[config.name]
    weights = [b for b in table_buffers(graphdef, optimizer, state).buffers if b.field == "weight"]
    n_shards, slots = slot_shards(weights, key, device)
    rows = config.num_embeddings
    return held_rows(weights, key, slots, -(-rows // n_shards), rows)
