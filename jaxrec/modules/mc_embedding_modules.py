"""Managed-collision embedding collections: remap raw ids, reset evicted rows, look up.

TorchRec's ``ManagedCollisionEmbeddingBagCollection`` and
``ManagedCollisionEmbeddingCollection``: a :class:`ManagedCollisionCollection`
maps each feature's raw ids to table rows (admitting and evicting ids as it
goes), then an ``EmbeddingBagCollection`` / ``EmbeddingCollection`` looks the
rows up. In the order TorchRec's sharded modules use: remap (which may evict),
reset the evicted rows, look up::

    raw-id KJT --MCC (profile, evict every interval, remap)--> row KJT
                     |                                           |
                     '-- evicted rows --> re-initialise weights  |
                                          (+ optimizer state in  v
                                           the train step) --> EBC / EC --> output

Evicted rows get the table's initialiser (``weight_init_min/max`` uniform or
``init_fn``) and, inside :func:`jaxrec.train.make_train_step`, their sparse
optimizer state is reset to its initial value in the same step, before the
step's update (see :mod:`jaxrec.embedding.reset`). TorchRec's unsharded modules
leave evicted rows as they are (their ``evict`` is a TODO); its sharded ones
reset weights and momentum, which is what jaxrec does everywhere.

The fresh values are drawn from the module's ``reset_rngs`` stream: one key
per call, folded with the table's index and the row (reproducible row by
row; the stream's counter is part of the model state and of checkpoints).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from ..embedding.reset import reset_table_rows
from ..ops import BoundsCheckMode
from ..sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from .embedding_bag_collection import EmbeddingBagCollection
from .embedding_collection import EmbeddingCollection
from .hash_zch import HashZchManagedCollisionModule
from .mc_collection import ManagedCollisionCollection


class BaseManagedCollisionEmbeddingCollection(nnx.Module):
    """An EBC / EC behind a :class:`ManagedCollisionCollection` (see the module docs).

    Args:
        embedding_module: the ``EmbeddingBagCollection`` / ``EmbeddingCollection``.
        managed_collision_collection: one managed-collision module per table of
            ``embedding_module`` (same table names and features; each module's
            ``output_size()`` equal to the table's ``num_embeddings``).
        return_remapped_features: also return the remapped (row) KJT.
        rngs: ``nnx.Rngs`` whose ``params`` stream seeds the re-initialisation
            of evicted rows (default: a fixed key 0).
        deterministic: flax's mode flag: ``False`` trains (ids are profiled and
            evicted, evicted rows reset), ``True`` only remaps. ``None`` (the
            default) leaves it to each managed-collision module's own flag.
    """

    _embedding_type: type = object
    _configs_method: str = ""

    def __init__(
        self,
        embedding_module: Any,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        *,
        rngs: nnx.Rngs | None = None,
        deterministic: bool | None = None,
    ):
        if not isinstance(embedding_module, self._embedding_type):
            raise TypeError(
                f"{type(self).__name__} needs an {self._embedding_type.__name__}, got "
                f"{type(embedding_module).__name__}"
            )
        if not isinstance(managed_collision_collection, ManagedCollisionCollection):
            raise TypeError(
                "managed_collision_collection must be a ManagedCollisionCollection, got "
                f"{type(managed_collision_collection).__name__}"
            )
        _check_tables(
            getattr(embedding_module, self._configs_method)(),
            managed_collision_collection,
            embedding_module.bounds_check_mode,
        )
        self._embedding_module = embedding_module
        self._managed_collision_collection = managed_collision_collection
        self._return_remapped_features = bool(return_remapped_features)
        self.deterministic = deterministic
        key = rngs.params() if rngs is not None else jax.random.key(0)
        self.reset_rngs = nnx.Rngs(reset=key)

    @property
    def managed_collision_collection(self) -> ManagedCollisionCollection:
        return self._managed_collision_collection

    def __call__(
        self, features: KeyedJaggedTensor, *, deterministic: bool | None = None
    ) -> tuple[Any, KeyedJaggedTensor | None]:
        """``(embedding output, remapped KJT or None)``, as TorchRec returns them.

        Args:
            features: raw ids (int32 / uint32 values; see
                :class:`~jaxrec.modules.MCHManagedCollisionModule` for 64-bit ids).
            deterministic: overrides the mode for this call (``True``: eval).
        """
        features.require_uniform_stride(type(self).__name__)
        if deterministic is None:
            deterministic = self.deterministic
        mcc = self._managed_collision_collection
        remapped = mcc(features, deterministic=deterministic)
        evictions = mcc.evict()
        key = self.reset_rngs.reset()  # one key per call, whether it evicts or not
        for name, mc in mcc.managed_collision_modules.items():
            if not mc.is_training(deterministic):  # eval: evict() still holds older rows
                continue
            reset_table_rows(self._embedding_module, name, evictions[name], key)
        out = self._embedding_module(remapped)
        return out, (remapped if self._return_remapped_features else None)

    def ensure_buffers(self, features: KeyedJaggedTensor) -> None:
        """Allocates the managed-collision history for ``features``' capacities.

        Call it once, eagerly, before :func:`jaxrec.train.init_train_state` when
        the modules were built without ``history_capacity``.
        """
        self._managed_collision_collection.ensure_buffers(features)

    def evict(self) -> dict[str, jax.Array]:
        """Table -> rows evicted (and reset) by the latest training call, fill-padded."""
        return self._managed_collision_collection.evict()

    def open_slots(self) -> dict[str, jax.Array]:
        return self._managed_collision_collection.open_slots()


class ManagedCollisionEmbeddingBagCollection(BaseManagedCollisionEmbeddingCollection):
    """An ``EmbeddingBagCollection`` whose raw ids are remapped by managed collision.

    TorchRec's ``ManagedCollisionEmbeddingBagCollection``: returns
    ``(KeyedTensor [B, sum(D)], remapped KJT | None)``. Evicted rows are reset
    to the table's initialiser before the lookup, and their optimizer state in
    the train step (see the module docs).

    Args:
        embedding_bag_collection: the tables.
        managed_collision_collection: a module per table, ``output_size() ==
            num_embeddings``.
        return_remapped_features: also return the row KJT.
        rngs, deterministic: see :class:`BaseManagedCollisionEmbeddingCollection`.

    Example:
        >>> tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=100,
        ...                              feature_names=["f"])]
        >>> mcc = ManagedCollisionCollection(
        ...     {"t": MCHManagedCollisionModule(100, eviction_policy=LFU_EvictionPolicy(),
        ...                                     eviction_interval=10, history_capacity=640)},
        ...     tables)
        >>> mc_ebc = ManagedCollisionEmbeddingBagCollection(
        ...     EmbeddingBagCollection(tables, rngs=nnx.Rngs(0)), mcc,
        ...     return_remapped_features=True)
        >>> kjt = KeyedJaggedTensor(["f"], [10**9, 7, 10**9], lengths=[2, 1])
        >>> pooled, remapped = mc_ebc(kjt)
        >>> pooled.values().shape, remapped.values().dtype
        ((2, 4), dtype('int32'))
    """

    _embedding_type = EmbeddingBagCollection
    _configs_method = "embedding_bag_configs"

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        *,
        rngs: nnx.Rngs | None = None,
        deterministic: bool | None = None,
    ):
        super().__init__(
            embedding_bag_collection,
            managed_collision_collection,
            return_remapped_features,
            rngs=rngs,
            deterministic=deterministic,
        )

    @property
    def embedding_bag_collection(self) -> EmbeddingBagCollection:
        return self._embedding_module

    def __call__(
        self, features: KeyedJaggedTensor, *, deterministic: bool | None = None
    ) -> tuple[KeyedTensor, KeyedJaggedTensor | None]:
        return super().__call__(features, deterministic=deterministic)


class ManagedCollisionEmbeddingCollection(BaseManagedCollisionEmbeddingCollection):
    """An ``EmbeddingCollection`` whose raw ids are remapped by managed collision.

    TorchRec's ``ManagedCollisionEmbeddingCollection``: returns
    ``({embedding name: JaggedTensor}, remapped KJT | None)``; with the EC's
    ``need_indices`` the returned ids are the remapped rows. Evicted rows are
    reset as in :class:`ManagedCollisionEmbeddingBagCollection`.
    """

    _embedding_type = EmbeddingCollection
    _configs_method = "embedding_configs"

    def __init__(
        self,
        embedding_collection: EmbeddingCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        *,
        rngs: nnx.Rngs | None = None,
        deterministic: bool | None = None,
    ):
        super().__init__(
            embedding_collection,
            managed_collision_collection,
            return_remapped_features,
            rngs=rngs,
            deterministic=deterministic,
        )

    @property
    def embedding_collection(self) -> EmbeddingCollection:
        return self._embedding_module

    def __call__(
        self, features: KeyedJaggedTensor, *, deterministic: bool | None = None
    ) -> tuple[dict[str, JaggedTensor], KeyedJaggedTensor | None]:
        return super().__call__(features, deterministic=deterministic)


def _check_tables(configs: list, mcc: ManagedCollisionCollection, embedding_bounds) -> None:
    """The collection's tables and the MCC's must agree (TorchRec asserts equal configs)."""
    mine = {c.name: c for c in configs}
    theirs = {c.name: c for c in mcc.embedding_configs()}
    if set(mine) != set(theirs):
        raise ValueError(
            "the embedding collection and the managed collision collection must have the same "
            f"tables: only in the embedding collection {sorted(set(mine) - set(theirs))}, only "
            f"in the managed collision collection {sorted(set(theirs) - set(mine))}"
        )
    modules = mcc.managed_collision_modules
    for name, c in mine.items():
        other = theirs[name]
        if tuple(c.feature_names) != tuple(other.feature_names):
            raise ValueError(
                f"table {name!r} reads features {list(c.feature_names)} in the embedding "
                f"collection but {list(other.feature_names)} in the managed collision collection"
            )
        if isinstance(modules[name], HashZchManagedCollisionModule) and embedding_bounds not in (
            BoundsCheckMode.IGNORE,
        ):
            raise ValueError(
                f"table {name!r} is a dynamic table (HashZchManagedCollisionModule): ids it gives "
                "no slot map out of range on purpose (they read zeros and train nothing, and "
                "the module counts them), so build the embedding collection with "
                f"bounds_check_mode=BoundsCheckMode.IGNORE (it has {embedding_bounds})"
            )
        size = modules[name].output_size()
        if c.num_embeddings != size:
            raise ValueError(
                f"table {name!r} has num_embeddings={c.num_embeddings} but its managed-collision "
                f"module maps ids into output_size()={size} rows; make them equal"
            )
