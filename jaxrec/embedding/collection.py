"""The embedding-collection contract: what the train step, the optimizer and checkpoints need.

A collection that holds embedding tables (``EmbeddingBagCollection`` and
``EmbeddingCollection`` through ``TableStorage``, the sharded collections of
``jaxrec.distributed``) subclasses :class:`EmbeddingCollectionInterface`;
``CombinedOptimizer``, ``jaxrec.train`` and ``jaxrec.checkpoint`` find
collections with ``isinstance`` and reach their tables only through these
methods. Quantized collections are inference-only: the unsharded ones do not
take part (their rows are not ``EmbeddingTable`` s, no optimizer sees them);
the sharded ones inherit the contract and refuse the training methods.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
from flax import nnx
from flax.nnx.module import ModuleMeta

from ..configs import BaseEmbeddingConfig
from ..ops import Implementation
from ..xla.bounds import BoundsCheckMode
from .blocks import TableBlocks


class PlanLocal(nnx.Variable):
    """A variable shaped by the sharding plan (per-device diagnostics such as the
    sharded collections' overflow counts): not part of the plan-independent state, so
    checkpoints leave it out and a restored state keeps the target's value."""


class LookupGrad(NamedTuple):
    """One call of a collection in a train step: what it looked up and the gradient
    of the loss with respect to its (tapped) output."""

    features: Any  # the KeyedJaggedTensor of the call
    grad: Any  # d loss / d output, shaped like the call's tapped output


class GradSource(NamedTuple):
    """Per-id row gradients of one table group, described without forming them.

    Id ``c`` adds ``out_grad[seg[c]] * scale[c]`` to row ``rows[c]`` when
    ``valid[c]`` (see ``jaxrec.xla.backward.pooled_grad_sources``).
    """

    out_grad: jax.Array  # [S, D] output-gradient rows
    seg: jax.Array  # [C] int32: output row of each id
    scale: jax.Array  # [C] float32: per-id factor (weights, 1 / bag length for MEAN)
    rows: jax.Array  # [C] int32: table row of each id in the stacked group
    valid: jax.Array  # [C] bool


class ContractMeta(ModuleMeta, abc.ABCMeta):
    """nnx's module metaclass with ``abc``'s: a module class that leaves an
    ``@abc.abstractmethod`` unimplemented cannot be instantiated (``TypeError``
    naming the missing methods)."""


class EmbeddingCollectionInterface(nnx.Module, metaclass=ContractMeta):
    """Base of every collection that holds trainable embedding tables.

    Attributes:
        table_configs: the tables, in the collection's order.
        prefix: the ``state_dict`` key prefix (``"embedding_bags"`` / ``"embeddings"``).
        weights: an ``nnx.Dict`` of ``EmbeddingTable`` buffers by name; the
            train step hands a collection its buffers under these names.
        mesh: the device mesh of a sharded collection, ``None`` when unsharded.
        implementation: the lookups' implementation (``jaxrec.ops.Implementation``).
        bounds_check_mode: out-of-range id handling for lookups.

    ``weights``, ``implementation`` and ``bounds_check_mode`` are declared here
    (annotations only, no class value) and set by every subclass's ``__init__``.

    Subclasses implement the abstract methods below: one that leaves any out
    cannot be instantiated (``TypeError`` naming them). ``optimizer`` is always the
    ``CombinedOptimizer`` and ``path`` the collection's module path in the model
    (the prefix of its optimizer-state keys, see ``state_key``).
    """

    table_configs: tuple[BaseEmbeddingConfig, ...] = ()
    prefix: str = ""
    mesh: jax.sharding.Mesh | None = None
    weights: nnx.Dict
    implementation: Implementation
    bounds_check_mode: BoundsCheckMode

    @abc.abstractmethod
    def init_optimizer_state(self, optimizer: Any, path: tuple) -> dict[str, Any]:
        """``{state_key: zeroed sparse optimizer state}`` for this collection's buffers."""

    @abc.abstractmethod
    def apply_sparse_gradients(
        self,
        optimizer: Any,
        path: tuple,
        weights: Mapping[str, jax.Array],
        sparse_state: Mapping[str, Any],
        calls: Sequence[LookupGrad],
        *,
        dep: jax.Array,
        implementation: Implementation = None,
    ) -> tuple[dict[str, jax.Array], dict[str, Any]]:
        """One fused optimizer step on the rows this step's ``calls`` looked up.

        Args:
            weights: ``{name: buffer}`` of every buffer in ``self.weights``
                (donated; updated in place).
            sparse_state: ``CombinedOptState.sparse`` (every collection's).
            calls: this collection's calls in the step, in call order.
            dep: a scalar every row update must depend on (0 times it is
                added): it orders the forward's table reads before the in-place
                writes (see ``jaxrec.train.table_update``).
            implementation: the row update's implementation (``None``, ``"xla"``,
                ``"pallas"``, ``"cpu"`` or
                ``"mosaic_gpu"``).

        Returns:
            ``(weights, sparse_state)``: the new buffers (same names) and the
            whole sparse state with this collection's entries replaced.
        """

    @abc.abstractmethod
    def reset_optimizer_rows(
        self, optimizer: Any, path: tuple, group: str, sparse_state: Mapping, rows: jax.Array
    ) -> dict[str, Any]:
        """``sparse_state`` with buffer ``group``'s state rows ``rows`` ``[K]`` at their
        initial values (fill entries ``>=`` the buffer's rows are ignored)."""

    @abc.abstractmethod
    def table_blocks(self, optimizer: Any, path: tuple) -> TableBlocks:
        """Where each table's rows sit in this collection's weight buffers and sparse
        optimizer states (``state_key`` s under ``path``); see ``blocks.py``."""


def embedding_collections(
    model: nnx.Module,
) -> Iterator[tuple[tuple, EmbeddingCollectionInterface]]:
    """``(path, collection)`` for every embedding collection in the model."""
    for path, module in nnx.iter_modules(model):
        if isinstance(module, EmbeddingCollectionInterface):
            yield path, module


def replace_collection(model: nnx.Module, path: tuple, new: nnx.Module) -> None:
    """Puts ``new`` at ``path`` (from ``nnx.iter_modules``; not empty) of ``model``, in place.

    Used to swap a collection for its sharded or quantized form. ``path``
    entries are attribute names, or keys / indices of ``nnx.Dict`` / ``nnx.List``.
    """
    parent = model
    for key in path[:-1]:
        parent = (
            _entries(parent, key)[key]
            if isinstance(key, int) or not hasattr(parent, key)
            else getattr(parent, key)
        )
    if isinstance(parent, nnx.Dict | nnx.List) or isinstance(path[-1], int):
        _entries(parent, path[-1])[path[-1]] = new
    else:
        setattr(parent, path[-1], new)


def _entries(parent: nnx.Module, key: str | int) -> nnx.Dict | nnx.List:
    """``parent`` as the ``nnx.Dict`` / ``nnx.List`` a path ``key`` indexes."""
    if not isinstance(parent, nnx.Dict | nnx.List):
        raise TypeError(
            f"path entry {key!r}: {type(parent).__name__} is not an nnx.Dict / nnx.List "
            "and has no such attribute"
        )
    return parent
