"""Rows a train step may change, marked on the device: what a delta checkpoint publishes.

A table row changes only through a train step's sparse update, and every row
that update writes (managed-collision resets included: their rows are looked
up in the same step) is an id of one of the step's collection calls. So
marking the ``(table, row)`` of every id the train step's tape sees
(``tape.tap``) finds every changed row (and a few looked-up rows whose update
was zero: a superset). The marks are one bool per row, ``[num_embeddings]``
per table, in a :class:`TouchedRows` variable the collection carries: they
travel in ``TrainState.rest`` through the donated step, so the step needs no
change and does no host work. Skipped steps (``skip_nonfinite``, a failed
``FATAL`` check) restore ``rest``, so they mark nothing.

Sharded collections: each table's mask is split by rows over the collection's
mesh (its length padded to a multiple of the devices), and the scatter of a
call's ids into it runs where the mask rows live: XLA gathers the batch's ids
to every device (an all-gather of the global batch's ids, 4 bytes each, small
beside the step's embedding exchange) and each device marks its own rows.

A model is tracked from :func:`track_touched_rows` on (call it on the model
being trained, after sharding it); ``jaxrec.checkpoint.ModelDeltaTracker``
reads and clears the marks when it publishes a delta.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeAlias

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..sparse import KeyedJaggedTensor
from ..xla.slots import FeatureSlot, slot_positions
from .collection import EmbeddingCollectionInterface, PlanLocal, embedding_collections

ATTRIBUTE = "touched_rows"  # the collection attribute holding its tables' marks


class TouchedRows(PlanLocal):
    """One table's rows looked up by train steps since the marks were last cleared:
    bool ``[rows]`` (``rows >= num_embeddings``: a sharded collection pads it to a
    multiple of its devices). Not checkpointed (a :class:`PlanLocal`): a restored
    state keeps the target's marks."""


def track_touched_rows(model: nnx.Module) -> nnx.Module:
    """Gives every embedding collection of ``model`` (in place) a zeroed
    :class:`TouchedRows` per table, which train steps then mark.

    Call it on the model that is trained: after ``DistributedModelParallel`` (a
    sharded collection replaces the unsharded one and its marks), before
    ``init_train_state`` (the marks are variables of the state). Calling it again
    clears the marks.

    Returns:
        ``model``.

    Raises:
        ValueError: the model has no embedding collection.

    Example:
        >>> model = track_touched_rows(model)
        >>> graphdef, state = init_train_state(model, optimizer)
    """
    found = list(embedding_collections(model))
    if not found:
        raise ValueError(
            f"track_touched_rows: {type(model).__name__} holds no embedding collection "
            "(EmbeddingCollectionInterface); there are no table rows to track"
        )
    for _, module in found:
        marks = {
            t.name: TouchedRows(zero_marks(module, t.num_embeddings)) for t in module.table_configs
        }
        setattr(module, ATTRIBUTE, nnx.Dict(marks))
    return model


def zero_marks(module: EmbeddingCollectionInterface, rows: int) -> jax.Array:
    """A cleared mask for a table of ``rows`` rows of ``module``: bool ``[rows]``, or
    ``[rows padded to the mesh size]`` split by rows over a sharded collection's mesh."""
    mesh = module.mesh
    if mesh is None:
        return jnp.zeros((rows,), jnp.bool_)
    padded = -(-rows // mesh.size) * mesh.size
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return jax.device_put(jnp.zeros((padded,), jnp.bool_), sharding)


class HoldsFeatures(Protocol):
    """A sharded call's batch with its ids received ahead (``input_dist.Prefetched``)."""

    @property
    def kjt(self) -> KeyedJaggedTensor: ...


CallFeatures: TypeAlias = KeyedJaggedTensor | HoldsFeatures  # what a collection call looked up


def is_tracked(module: object) -> bool:
    """Whether ``module`` carries touched-row marks (:func:`track_touched_rows`)."""
    return isinstance(getattr(module, ATTRIBUTE, None), nnx.Dict)


def mark_touched(module: EmbeddingCollectionInterface, features: CallFeatures) -> None:
    """Marks, in ``module``'s :class:`TouchedRows`, the rows of every valid id of
    ``features`` (a no-op for a module :func:`track_touched_rows` did not track).

    Args:
        module: the embedding collection called.
        features: the call's ``KeyedJaggedTensor`` (leaves ``[world, ...]``: a sharded
            call's stacked one), or an object holding it as ``.kjt`` (a pipelined
            sharded call's ids received ahead). Ids out of ``[0, num_embeddings)``
            are not marked: no update writes them.
    """
    if not is_tracked(module):
        return
    kjt = features if isinstance(features, KeyedJaggedTensor) else getattr(features, "kjt", None)
    if not isinstance(kjt, KeyedJaggedTensor):
        raise TypeError(
            f"mark_touched: features of {type(module).__name__} must be a KeyedJaggedTensor "
            f"(or hold one as .kjt), got {type(features).__name__}"
        )
    marks = getattr(module, ATTRIBUTE)
    for t in module.table_configs:
        mask = marks[t.name].get_value()
        rows = table_rows(kjt, t.feature_names, t.num_embeddings, fill=mask.shape[0])
        marks[t.name].set_value(mask.at[rows].set(True, mode="drop"))


def table_rows(
    kjt: KeyedJaggedTensor, features: Iterable[str], num_embeddings: int, *, fill: int
) -> jax.Array:
    """``[N]`` int32: the table row of every id of ``features`` in ``kjt`` (flattened over
    a stacked KJT's devices); ``fill`` (past the mask's end: dropped by the scatter)
    for padding and ids outside ``[0, num_embeddings)``."""
    slots = [FeatureSlot(key=f, row_offset=0, num_embeddings=num_embeddings) for f in features]

    def rows(local: KeyedJaggedTensor) -> jax.Array:
        pos = slot_positions(local, slots)
        ids = pos.ids.astype(jnp.int32)
        ok = pos.valid & (ids >= 0) & (ids < num_embeddings)
        return jnp.where(ok, ids, fill)

    if kjt.values().ndim == 1:
        return rows(kjt)
    return jax.vmap(rows)(kjt).reshape(-1)
