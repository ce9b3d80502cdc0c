"""The DLRM job's dynamic tables (``--dynamic-tables SLOTS``): every table keyed by the
raw id through a hash index with admission and eviction (``HashZchManagedCollisionModule``
behind a ``ManagedCollisionEmbeddingBagCollection``)."""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from ..configs import EmbeddingBagConfig
from ..datasets import Part, TableDataset
from ..models import DLRM
from ..modules import (
    EmbeddingBagCollection,
    FrequencyAdmission,
    HashZchEvictionConfig,
    HashZchEvictionPolicyName,
    HashZchManagedCollisionModule,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
)
from ..ops import BoundsCheckMode
from ..train import TrainState
from .dlrm_config import DlrmJobConfig

POLICIES = {
    "lru": HashZchEvictionPolicyName.LRU_EVICTION,
    "lfu": HashZchEvictionPolicyName.LFU_EVICTION,
    "ttl": HashZchEvictionPolicyName.SINGLE_TTL_EVICTION,
}


def check_dynamic_flags(config: DlrmJobConfig) -> None:
    """Fails early on dynamic-table flags that cannot work together."""
    if not config.dynamic_tables:
        return
    slots, ways, n = config.dynamic_tables, config.dynamic_ways, config.devices
    unit = max(ways, 1) * n
    if slots < 0 or ways < 1 or slots % unit:
        raise SystemExit(
            f"--dynamic-tables {slots}: a multiple of --dynamic-ways ({ways}) x --devices "
            f"({n}) (whole hash buckets on every device), e.g. {max(1, slots // unit) * unit}"
        )
    if config.sharding not in ("planner", "row_wise"):
        raise SystemExit(
            f"--dynamic-tables shard row-wise by the id's hash; --sharding {config.sharding} "
            "cannot apply (leave the default or pass row_wise)"
        )
    if config.cache_tables or config.hbm_gib is not None:
        raise SystemExit(
            "--dynamic-tables keep their rows on the devices: drop --cache-tables and --hbm-gib"
        )
    if config.dynamic_admission < 1 or config.dynamic_ttl < 1:
        raise SystemExit("--dynamic-admission and --dynamic-ttl must be >= 1")


def dynamic_configs(configs: list[EmbeddingBagConfig], slots: int) -> list[EmbeddingBagConfig]:
    """The tables with ``slots`` rows each (the ids' range no longer sizes them)."""
    return [dataclasses.replace(c, num_embeddings=slots) for c in configs]


def dynamic_collection(
    config: DlrmJobConfig, configs: list[EmbeddingBagConfig], seed: int
) -> ManagedCollisionEmbeddingBagCollection:
    """An EBC of ``configs`` behind one hash index per table."""
    tables = dynamic_configs(configs, config.dynamic_tables)
    ttl = config.dynamic_ttl if config.dynamic_eviction == "ttl" else None
    eviction = HashZchEvictionConfig(policy=POLICIES[config.dynamic_eviction], single_ttl=ttl)
    admission = (
        FrequencyAdmission(threshold=config.dynamic_admission)
        if config.dynamic_admission > 1
        else None
    )
    modules = {
        c.name: HashZchManagedCollisionModule(
            c.num_embeddings,
            ways=config.dynamic_ways,
            eviction_config=eviction,
            admission=admission,
            input_hash_seed=i,
            name=c.name,
        )
        for i, c in enumerate(tables)
    }
    ebc = EmbeddingBagCollection(
        tables, rngs=nnx.Rngs(seed), bounds_check_mode=BoundsCheckMode.IGNORE
    )
    return ManagedCollisionEmbeddingBagCollection(
        ebc, ManagedCollisionCollection(modules, tables), rngs=nnx.Rngs(seed + 7)
    )


def dynamic_counters(
    collection: ManagedCollisionEmbeddingBagCollection,
) -> dict[str, dict[str, int]]:
    """Table -> the latest training step's ``admitted``/``evicted``/``rejected`` and the
    ``occupancy`` (host ints) of a model's dynamic tables (unsharded or sharded)."""
    mcc = collection.managed_collision_collection
    return {
        table: {k: int(np.asarray(v).sum()) for k, v in counts.items()}
        for table, counts in mcc.counters().items()
    }


def _dynamic_collection_of(model: nnx.Module) -> ManagedCollisionEmbeddingBagCollection:
    """The job's DLRM's collection behind its dynamic tables' indexes."""
    if not isinstance(model, DLRM):
        raise TypeError(f"the DLRM job's model is a DLRM or DLRM_DCN, got {type(model).__name__}")
    ebc = model.sparse_arch.embedding_bag_collection
    if not isinstance(ebc, ManagedCollisionEmbeddingBagCollection):
        raise TypeError(
            f"the model has no dynamic tables: its collection is a {type(ebc).__name__}"
        )
    return ebc


def ensure_dynamic_buffers(model: nnx.Module, data: TableDataset, config: DlrmJobConfig) -> None:
    """Allocates the indexes' eviction buffers for one local batch (eagerly, before the
    train state is made: a jitted step cannot add variables)."""
    batch = next(iter(data.batches(config.batch_size, shuffle=False, part=Part(0, 1))))
    _dynamic_collection_of(model).ensure_buffers(batch.sparse_features)


def dynamic_summary(graphdef: nnx.GraphDef, state: TrainState) -> dict[str, dict[str, int]]:
    """:func:`dynamic_counters` of the model in a train ``state``."""
    model = nnx.merge(graphdef, state.params, state.tables, state.rest)
    return dynamic_counters(_dynamic_collection_of(model))


def dynamic_text(counters: dict[str, dict[str, int]]) -> str:
    """One log line: each dynamic table's occupancy and the last step's counts."""
    parts = [
        f"{t} occupancy {c['occupancy']:,}, last step +{c['admitted']} -{c['evicted']} "
        f"rejected {c['rejected']}"
        for t, c in counters.items()
    ]
    return "dynamic tables: " + "; ".join(parts)
