"""Input distribution ahead of the step (TorchRec's ``TrainPipelineSparseDist`` split).

A sharded lookup first sends every id to the rank holding its row: round 0
of the exchange, one ``all_to_all`` per width group (``exchange.py``). That
stage reads the batch alone, so a pipelined train step
(``jaxrec.train.make_sparse_dist_train_step``) runs it for batch ``i + 1``
inside step ``i``'s program, where nothing of step ``i`` waits for it (XLA
may overlap it with step ``i``'s compute), and step ``i + 1`` starts from the
ids already there. Two modes, set by that step while it traces:

* :func:`recording`: the model runs on the next batch; every sharded
  collection call sends its ids (:func:`distribute`), records what arrived
  under its module path and returns zeros (the rest of that forward is dead
  code, which XLA removes);
* :func:`feeding`: every sharded collection call takes the ids recorded
  under its path (:func:`fed`) instead of sending them again, in the forward
  and in the sparse update.

Exact overflow (``overflow="exact"``): the rounds beyond round 0 and their
count (a ``pmax`` over devices) stay in the consuming step, computed from its
own batch as in the unpipelined step; they are rare and need every device's
counts. So the pipelined step is the unpipelined one with round 0's
``all_to_all`` moved one step earlier: the same ids, the same results.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..embedding.tape import call_path
from ..sparse import KeyedJaggedTensor
from ..xla.bounds import collect_checks
from . import exchange
from .embedding_dist import local_kjt

# {collection path "a.b": {width group: [world, N_src, width] int32 round-0 payloads}}
DistributedIds = dict[str, dict[str, jax.Array]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefetched:
    """A sharded call's batch with its round-0 ids already received (leaves ``[world, ...]``).

    ``keep`` (``[world]`` bool, or None) masks the received ids: a train step
    that skips its update zeroes the batch's lengths and sets ``keep`` False,
    so that the update sees no id, as it would from the zeroed batch.
    """

    kjt: KeyedJaggedTensor  # the stacked KeyedJaggedTensor of the call
    received: dict[str, jax.Array]  # width group -> [world, N_src, width] int32
    keep: jax.Array | None = None

    def masked(self, kjt: KeyedJaggedTensor, ok: jax.Array) -> Prefetched:
        """This call on ``kjt`` (its lengths zeroed unless ``ok``), its ids kept iff ``ok``."""
        world = jax.tree.leaves(kjt)[0].shape[0]
        return dataclasses.replace(self, kjt=kjt, keep=jnp.broadcast_to(ok, (world,)))


@dataclasses.dataclass
class _Recording:
    found: DistributedIds = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Feeding:
    ids: DistributedIds
    used: set = dataclasses.field(default_factory=set)


_MODE: contextvars.ContextVar[_Recording | _Feeding | None] = contextvars.ContextVar(
    "jaxrec_input_dist", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[DistributedIds]:
    """Inside, sharded collection calls distribute their ids into the yielded dict and
    return zeros (run the model under a ``jaxrec.embedding.tape.Tape``: paths come from it)."""
    rec = _Recording()
    token = _MODE.set(rec)
    try:
        yield rec.found
    finally:
        _MODE.reset(token)


@contextlib.contextmanager
def feeding(ids: DistributedIds) -> Iterator[None]:
    """Inside, sharded collection calls take their round-0 ids from ``ids``; every entry
    must be taken (the model must call the same collections on every batch)."""
    feed = _Feeding(dict(ids))
    token = _MODE.set(feed)
    try:
        yield
    finally:
        _MODE.reset(token)
    unused = sorted(set(feed.ids) - feed.used)
    if unused:
        raise ValueError(
            f"ids were distributed ahead for sharded collections {unused}, which this step "
            "did not call; a pipelined step needs the same collection calls on every batch"
        )


def is_recording() -> bool:
    return isinstance(_MODE.get(), _Recording)


def record(collection: Any, features: KeyedJaggedTensor) -> Any:
    """Recording mode's call: distributes ``features``' ids, returns zeros shaped like the
    call's output."""
    mode = _MODE.get()
    if not isinstance(mode, _Recording):
        raise RuntimeError("input_dist.record is for recording mode only (see is_recording)")
    found = mode.found
    key = _key(collection)
    if key in found:
        raise NotImplementedError(
            f"the sharded collection at {key!r} was called twice on one batch; a pipelined "
            "step distributes one call's ids per collection"
        )
    found[key] = distribute(collection, features)
    tables = {name: v.get_value() for name, v in collection.weights.items()}

    def forward(tables, features):
        with collect_checks(warnings=True):  # shapes only: no report may leave
            return collection._forward(tables, features)[0]

    shapes = jax.eval_shape(forward, tables, features)
    values = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return collection._finish(values, features)


def fed(collection: Any, features: KeyedJaggedTensor) -> KeyedJaggedTensor | Prefetched:
    """``features``, or a :class:`Prefetched` of them in feeding mode."""
    feed = _MODE.get()
    if not isinstance(feed, _Feeding):
        return features
    key = _key(collection)
    if key not in feed.ids:
        raise ValueError(
            f"the sharded collection at {key!r} was called, but its ids were not distributed "
            "ahead (the model did not call it on this batch when the previous step "
            "distributed it); a pipelined step needs the same collection calls on every batch"
        )
    feed.used.add(key)
    return Prefetched(features, feed.ids[key])


def distribute(collection: Any, features: KeyedJaggedTensor) -> dict[str, jax.Array]:
    """Round 0 of ``collection``'s id exchange for the stacked batch ``features``:
    ``{width group: [world, N_src, width] int32}``, sharded over the devices."""

    def local(kjt_stacked):
        kjt = local_kjt(kjt_stacked)
        return {
            g.name: exchange.send(box, spec, 0, collection.axis, first=True)[None]
            for g, spec, box in collection._exchanges(kjt)
        }

    spec = P(collection.axis)
    run = jax.shard_map(local, mesh=collection.mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return run(features)


def split(local: KeyedJaggedTensor | Prefetched) -> tuple[KeyedJaggedTensor, Prefetched | None]:
    """``(kjt, prefetched or None)`` of a call's local (per-device) features."""
    if isinstance(local, Prefetched):
        return local.kjt, local
    return local, None


def attach(box: exchange.Outbox, spec: exchange.Spec, pre: Prefetched | None, group: str):
    """``box`` with round 0 as received ahead (a local ``[N_src, width]``), if any."""
    if pre is None:
        return box
    got = pre.received[group]
    want = (spec.n, spec.width(True))
    if got.shape != want:
        raise ValueError(
            f"the ids distributed ahead for width group {group!r} are {got.shape}, this "
            f"batch's exchange needs {want}: distribute each batch for the step that consumes it"
        )
    if pre.keep is not None:  # a skipped step: nothing arrived, as from the zeroed batch
        got = jnp.where(pre.keep, got, jnp.broadcast_to(exchange.empty(spec, True), want))
    return dataclasses.replace(box, ahead=got)


def _key(collection: Any) -> str:
    return ".".join(map(str, call_path(collection)))
