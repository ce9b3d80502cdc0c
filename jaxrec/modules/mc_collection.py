"""ManagedCollisionCollection: one managed-collision module per table, over a KJT."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ..configs import BaseEmbeddingConfig
from ..sparse import KeyedJaggedTensor
from ..sparse.ids64 import narrow_ids
from .hash_zch import HashZchManagedCollisionModule
from .mc_modules import MCHManagedCollisionModule

ManagedCollisionModule = MCHManagedCollisionModule | HashZchManagedCollisionModule


class ManagedCollisionCollection(nnx.Module):
    """Remaps a KJT's raw ids to table rows, one module per table (TorchRec's MCC).

    All features of a table share its module: they are recorded together
    (one history, one counter per call) and remapped by the same slot table,
    as in TorchRec.

    ::

        # table "t_user" (features "user", "viewer") -> mc_user
        # KJT keys   user | viewer | item          item: table "t_item" -> mc_item
        # values     raw ids      --> rows of t_user | rows of t_user | rows of t_item

    Args:
        managed_collision_modules: table name -> module; exactly the tables of
            ``embedding_configs``, each with ``output_size() == num_embeddings``.
        embedding_configs: the tables (``EmbeddingBagConfig`` / ``EmbeddingConfig``).

    Example:
        >>> cfg = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=100,
        ...                          feature_names=["f1", "f2"])
        >>> mcc = ManagedCollisionCollection(
        ...     {"t": MCHManagedCollisionModule(100, eviction_policy=LFU_EvictionPolicy(),
        ...                                     eviction_interval=1)}, [cfg])
        >>> kjt = KeyedJaggedTensor(["f1", "f2"], [10**9, 5, 10**9], lengths=[1, 1, 1, 0])
        >>> mcc(kjt).values()[0] == mcc(kjt).values()[2]   # same raw id, same row
        Array(True, dtype=bool)
    """

    def __init__(
        self,
        managed_collision_modules: Mapping[str, ManagedCollisionModule],
        embedding_configs: Sequence[BaseEmbeddingConfig],
    ):
        if not isinstance(managed_collision_modules, Mapping):
            raise TypeError(
                "managed_collision_modules must be a dict table name -> "
                f"MCHManagedCollisionModule, got {type(managed_collision_modules).__name__}"
            )
        configs = tuple(embedding_configs)
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise ValueError(f"embedding_configs repeat table names: {names}")
        if set(names) != set(managed_collision_modules):
            missing = sorted(set(names) - set(managed_collision_modules))
            extra = sorted(set(managed_collision_modules) - set(names))
            raise ValueError(
                f"managed_collision_modules must have one module per table: missing {missing}, "
                f"no table for {extra}"
            )
        feature_to_table: dict[str, str] = {}
        for c in configs:
            mc = managed_collision_modules[c.name]
            if not isinstance(mc, ManagedCollisionModule):
                raise TypeError(
                    f"module of table {c.name!r} is a {type(mc).__name__}; use an "
                    "MCHManagedCollisionModule or a HashZchManagedCollisionModule"
                )
            if mc.output_size() != c.num_embeddings:
                raise ValueError(
                    f"table {c.name!r} has num_embeddings={c.num_embeddings} but its module maps "
                    f"into output_size()={mc.output_size()} rows; make them equal"
                )
            for f in c.feature_names:
                if f in feature_to_table:
                    raise ValueError(
                        f"feature {f!r} feeds tables {feature_to_table[f]!r} and {c.name!r}; "
                        "a managed feature needs exactly one table"
                    )
                feature_to_table[f] = c.name
        self._configs = configs
        self._feature_to_table = feature_to_table
        self.managed_collision_modules = nnx.Dict(
            {c.name: managed_collision_modules[c.name] for c in configs}
        )

    def embedding_configs(self) -> list[BaseEmbeddingConfig]:
        return list(self._configs)

    def __call__(
        self, features: KeyedJaggedTensor, *, deterministic: bool | None = None
    ) -> KeyedJaggedTensor:
        """Raw-id KJT -> row KJT (same keys, capacities, lengths, weights; int32 values).

        Keys that belong to no table pass through (cast to int32).
        """
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
        keys = features.keys()
        missing = sorted(set(self._feature_to_table) - set(keys))
        if missing:
            raise ValueError(f"features lack the managed keys {missing}; the KJT has {keys}")

        def remap(name, flat, valid):
            return self.managed_collision_modules[name].forward_flat(
                flat, valid, deterministic=deterministic
            )

        return remap_by_table(features, self._configs, remap)

    def evict(self) -> dict[str, jax.Array]:
        """Table -> ``[E_t]`` int32 rows evicted by the latest training call (fill-padded)."""
        return {name: mc.evict() for name, mc in self.managed_collision_modules.items()}

    def open_slots(self) -> dict[str, jax.Array]:
        return {name: mc.open_slots() for name, mc in self.managed_collision_modules.items()}

    def counters(self) -> dict[str, dict[str, jax.Array]]:
        """Dynamic table -> its index's counters (``HashZchManagedCollisionModule.counters``)."""
        return {
            name: mc.counters()
            for name, mc in self.managed_collision_modules.items()
            if isinstance(mc, HashZchManagedCollisionModule)
        }

    def ensure_buffers(self, features: KeyedJaggedTensor) -> None:
        """Allocates every module's history for this KJT's capacities (eagerly, once)."""
        caps = dict(zip(features.keys(), features.capacity_per_key(), strict=True))
        for c in self._configs:
            total = sum(caps.get(name, 0) for name in c.feature_names)
            self.managed_collision_modules[c.name].ensure_buffers(total)


def remap_by_table(
    features: KeyedJaggedTensor,
    configs: Sequence[BaseEmbeddingConfig],
    remap: Callable[[str, jax.Array, jax.Array], jax.Array],
) -> KeyedJaggedTensor:
    """``features`` with each table's features remapped together, in one flat buffer.

    ``remap(table, values [C], valid [C]) -> int32 rows [C]`` gets the table's
    features' capacity slices side by side (``valid`` masks padding); keys of
    no table pass through (cast to int32). Keys, capacities, lengths and
    weights are unchanged.
    """
    keys, starts, values = features.keys(), features.capacity_offsets(), features.values()
    valid = features.segment_ids() < len(keys) * features.stride()
    plain = narrow_ids(values)  # keys of no table: 64-bit id words become int32 (-1: too wide)
    pieces = [plain[starts[i] : starts[i + 1]].astype(jnp.int32) for i in range(len(keys))]
    for c in configs:
        idx = [keys.index(name) for name in c.feature_names]
        flat = jnp.concatenate([values[starts[i] : starts[i + 1]] for i in idx])
        ok = jnp.concatenate([valid[starts[i] : starts[i + 1]] for i in idx])
        rows = remap(c.name, flat, ok)
        at = 0
        for i in idx:
            n = starts[i + 1] - starts[i]
            pieces[i] = rows[at : at + n]
            at += n
    out = jnp.concatenate(pieces) if pieces else plain.astype(jnp.int32)
    return KeyedJaggedTensor.from_parts(
        keys,
        out,
        features.lengths(),
        features.weights_or_none(),
        capacities=features.capacity_per_key(),
        stride=features.stride(),
    )
