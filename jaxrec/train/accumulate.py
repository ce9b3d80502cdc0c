"""Gradient accumulation: ``k`` micro-batches, one update equal to a step on their concatenation.

``make_accumulating_train_step`` runs the differentiated forward of
``forward.py`` on each micro-batch in a ``jax.lax.scan`` (the activations of one
micro-batch are alive at a time), sums the dense gradients in the scan's carry
and keeps every micro-batch's collection calls. It then applies one update:
the dense optax update from the mean gradient, and each collection's fused
sparse update over all ``k`` micro-batches' calls at once (``table_update.py``):
duplicate ids of different micro-batches are summed before the optimizer, so
every touched row gets exactly one optimizer step, as with the concatenated
batch. Stateful sparse optimizers (row-wise Adagrad, Adam) would drift from the
concatenated step if a row were updated once per micro-batch.

Conventions (see ``make_accumulating_train_step``):

* loss: the step's loss is the mean of the micro-batch losses
  (``loss_reduction="mean"``) or their sum (``"sum"``); gradients are those of
  that loss. A per-example mean loss over ``k`` equal micro-batches then equals
  the mean over the concatenated batch; a per-example sum needs ``"sum"``.
* ``rest`` (batch statistics, managed-collision state, overflow counts) is
  threaded through the micro-batches in order, as ``k`` forwards would leave it.
* guards: a ``FATAL`` bounds check or (``skip_nonfinite``) a non-finite loss or
  gradient in any micro-batch skips the whole step; report counts are summed.
* sharded collections take one call per step, so their ``k`` calls are merged
  into one: each device's ``k`` KJTs become one KJT of ``k * B`` bags (capacities
  ``k`` times larger) and the output gradients are interleaved to match. The
  backward's id exchange then runs once on the merged batch (sized for it),
  as a step on the concatenated batch would.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from ..embedding.collection import LookupGrad
from ..embedding.optimizer import CombinedOptimizer
from ..ops import Implementation
from ..sparse import KeyedJaggedTensor
from .forward import Forward, differentiate
from .step import LossFn, TrainState, TrainStep, apply_forward
from .table_update import CollectionCall

LossReduction = Literal["mean", "sum"]


class MicroBatchOutputs(NamedTuple):
    """What the scan keeps of each micro-batch (leaves stacked ``[k, ...]``)."""

    loss: jax.Array  # [k]
    aux: Any  # loss_fn's aux per micro-batch
    lookups: list[LookupGrad]  # every collection call, in call order
    resets: list[tuple[jax.Array, jax.Array]]  # (rows, old) of every row reset
    dropped: jax.Array | None  # [k] ids dropped for capacity (overflow="raise")
    fatal: dict  # where -> (count [k], example [k])
    warned: tuple  # (warnings, overflow, counts) of a StepReport, each [k, ...]


def stack_micro_batches(batches: Sequence[Any]) -> Any:
    """Stacks ``k`` micro-batches into one batch whose leaves have a leading axis ``k``.

    Every micro-batch must have the same pytree structure, and its
    KeyedJaggedTensors the same keys, capacities and stride (static data of one
    compiled step): build them with explicit ``capacities=``. Sharded batches
    (``jaxrec.distributed.shard_batch``) stack the same way: KJT leaves become
    ``[k, world, ...]``, arrays ``[k, world * B, ...]``.

    Args:
        batches: ``k >= 1`` batches as ``loss_fn`` takes them.

    Returns:
        the batch pytree with every leaf ``[k, *leaf.shape]`` (numpy leaves stay
        numpy, others become ``jax.Array`` s).

    Raises:
        ValueError: no batch, or batches that differ in structure, KJT layout,
            or a leaf's shape or dtype.

    Example:
        >>> batch = stack_micro_batches([(kjt0, y0), (kjt1, y1)])
        >>> state, loss, _ = step(state, batch)  # micro_batches=2
    """
    if len(batches) == 0:
        raise ValueError("stack_micro_batches: batches is empty; pass k >= 1 micro-batches")
    first = jax.tree.structure(batches[0])
    for i, b in enumerate(batches[1:], 1):
        if jax.tree.structure(b) != first:
            raise ValueError(
                f"stack_micro_batches: micro-batch {i} differs from micro-batch 0 in structure "
                f"or KeyedJaggedTensor layout:\n  {jax.tree.structure(b)}\n  vs {first}\n"
                "micro-batches need the same pytree, and their KeyedJaggedTensors the same "
                "keys, capacities and stride (build them with capacities=...)"
            )
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(batches[0])[0]]
    leaves = [jax.tree.leaves(b) for b in batches]
    out = []
    for j, path in enumerate(paths):
        column = [ls[j] for ls in leaves]
        got = [(np.shape(x), str(_dtype(x))) for x in column]
        if len(set(got)) != 1:
            raise ValueError(
                f"stack_micro_batches: leaf {jax.tree_util.keystr(path)} differs in shape or "
                f"dtype across micro-batches: {got}; pad every micro-batch to one shape"
            )
        on_host = all(isinstance(x, np.ndarray) for x in column)
        out.append(np.stack(column) if on_host else jnp.stack(column))
    return jax.tree.unflatten(first, out)


def _dtype(x: Any) -> np.dtype:  # any pytree leaf of a batch
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def make_accumulating_train_step(
    graphdef: nnx.GraphDef,
    optimizer: CombinedOptimizer,
    loss_fn: LossFn,
    *,
    micro_batches: int,
    loss_reduction: LossReduction = "mean",
    has_aux: bool = False,
    donate: bool = True,
    implementation: Implementation = None,
    skip_nonfinite: bool = False,
) -> TrainStep:
    """A jitted step ``step(state, batches) -> (state, loss, aux)`` over ``k`` micro-batches
    that applies one update, equal to one ``make_train_step`` step on their concatenation.

    ``batches`` is the micro-batches stacked (:func:`stack_micro_batches`): every
    leaf ``[k, ...]``. A ``jax.lax.scan`` differentiates ``loss_fn`` on one
    micro-batch at a time and sums the dense gradients; then the dense optimizer
    and every table's fused sparse optimizer step once (duplicate ids across
    micro-batches summed first). Memory: the dense activations of one
    micro-batch, plus the embedding output gradients of all ``k`` (needed by
    the one sparse update; as large as the concatenated batch's). See the
    module docstring for ``rest``, guards and sharded collections.

    Args:
        graphdef, optimizer, has_aux, donate, implementation, skip_nonfinite: as
            for :func:`~jaxrec.train.make_train_step`. ``skip_nonfinite`` and
            ``FATAL`` bounds checks skip the whole step if any micro-batch fails.
        loss_fn: ``loss_fn(model, micro_batch) -> loss`` (or ``(loss, aux)``).
        micro_batches: ``k >= 1``, the leading size of every leaf of ``batches``.
        loss_reduction: ``"mean"`` (default): the step's loss and gradients are
            the mean over micro-batches (a per-example mean loss over equal
            micro-batches then equals the concatenated batch's); ``"sum"``: their
            sum (for per-example sum losses).

    Returns:
        a :class:`~jaxrec.train.TrainStep` whose ``loss`` is the reduced loss
        (scalar) and ``aux`` each micro-batch's aux stacked ``[k, ...]``.

    Raises:
        ValueError: ``micro_batches`` < 1, ``loss_reduction`` unknown, or (when
            called) a leaf of ``batches`` without leading size ``micro_batches``.

    Example:
        >>> step = make_accumulating_train_step(graphdef, opt, loss_fn, micro_batches=4)
        >>> state, loss, _ = step(state, stack_micro_batches(four_batches))
    """
    if not isinstance(micro_batches, int | np.integer) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    scale = 1.0 / micro_batches if loss_reduction == "mean" else 1.0
    step = functools.partial(
        _accumulated_step,
        graphdef,
        optimizer,
        loss_fn,
        has_aux,
        implementation,
        skip_nonfinite,
        int(micro_batches),
        scale,
    )
    return TrainStep(jax.jit(step, donate_argnums=(0,) if donate else ()))


def _accumulated_step(
    graphdef, optimizer, loss_fn, has_aux, implementation, skip_nonfinite, k, scale, state, batches
):
    """One accumulated step, traced under ``jit``: ``(state, loss, aux, StepReport)``."""
    fwd = accumulate_gradients(graphdef, loss_fn, has_aux, state, batches, k, scale)
    new, report = apply_forward(optimizer, state, fwd, implementation, skip_nonfinite)
    return new, fwd.loss, fwd.aux, report


def accumulate_gradients(
    graphdef: nnx.GraphDef,
    loss_fn: Callable,
    has_aux: bool,
    state: TrainState,
    batches: Any,
    k: int,
    scale: float,
) -> Forward:
    """One :class:`~jaxrec.train.forward.Forward` for ``k`` stacked micro-batches: the
    scaled sum of their losses and gradients, and all their calls (sharded ones merged)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(batches)[0]:
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] != k:
            raise ValueError(
                f"batches leaf {jax.tree_util.keystr(path)} has shape {np.shape(leaf)}; with "
                f"micro_batches={k} every leaf needs leading size {k} "
                "(stack the micro-batches with stack_micro_batches)"
            )
    found: list = []  # the body's static structure (it is traced once)

    def body(carry, micro):
        g_sum, tables, rest = carry
        fwd = differentiate(
            graphdef, loss_fn, has_aux, state._replace(tables=tables, rest=rest), micro
        )
        found.append(([(c.path, c.collection) for c in fwd.calls], fwd.resets))
        g_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), g_sum, fwd.g_params)
        out = MicroBatchOutputs(
            loss=fwd.loss,
            aux=fwd.aux,
            lookups=[c.lookup for c in fwd.calls],
            resets=[(r.rows, r.old) for r in fwd.resets],
            dropped=fwd.dropped,
            fatal=fwd.fatal,
            warned=fwd.warned,
        )
        return (g_sum, fwd.tables, fwd.rest), out

    g_zero = jax.tree.map(lambda p: jnp.zeros(p.shape, _accumulator_dtype(p.dtype)), state.params)
    (g_sum, tables, rest), per = jax.lax.scan(body, (g_zero, state.tables, state.rest), batches)
    call_meta, reset_meta = found[-1]
    g_params = jax.tree.map(lambda s, p: (s * scale).astype(p.dtype), g_sum, state.params)
    loss = jnp.sum(per.loss) * scale
    return Forward(
        loss=loss.astype(per.loss.dtype),
        aux=per.aux,
        g_params=g_params,
        tables=tables,
        rest=rest,
        calls=_calls(call_meta, per.lookups, k, scale),
        resets=[
            dataclasses.replace(r, rows=rows[i], old=old[i])
            for i in range(k)
            for r, (rows, old) in zip(reset_meta, per.resets, strict=True)
        ],
        dropped=None if per.dropped is None else jnp.sum(per.dropped),
        fatal=_merge_checks(per.fatal),
        warned=_merge_warned(per.warned),
    )


def _accumulator_dtype(dtype: DTypeLike) -> DTypeLike:
    """float32 sums for low-precision params (their gradients add up k times)."""
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.inexact) else dtype


def _calls(meta, lookups: list[LookupGrad], k: int, scale: float) -> list[CollectionCall]:
    """The step's calls: an unsharded collection gets each micro-batch's call (its update
    sums duplicate ids over calls); a sharded one, whose update takes one call, the ``k``
    micro-batches' calls merged into one."""
    calls = []
    for (path, collection), lk in zip(meta, lookups, strict=True):
        if collection.mesh is not None:
            calls.append(CollectionCall(path, collection, merge_sharded_calls(lk, path, scale)))
            continue
        for i in range(k):
            one = jax.tree.map(lambda x, i=i: x[i], lk)
            grad = jax.tree.map(lambda g: g * jnp.asarray(scale, g.dtype), one.grad)
            calls.append(CollectionCall(path, collection, LookupGrad(one.features, grad)))
    return calls


def merge_sharded_calls(stacked: LookupGrad, path: tuple, scale: float) -> LookupGrad:
    """One call of a sharded pooled collection from its ``k`` micro-batch calls.

    Args:
        stacked: ``features`` a KJT with leaves ``[k, world, ...]`` (one local KJT
            per device and micro-batch), ``grad`` ``[k, world * B, D]`` (the
            collection's pooled output gradient, rows device-major).
        path: the collection's path (for errors).
        scale: the loss reduction's factor on the gradients.

    Returns:
        features with leaves ``[world, ...]``: device ``d``'s ``k`` KJTs as one of
        ``k * B`` bags (micro-batch-major, capacities times ``k``), and ``grad``
        ``[world * k * B, D]`` in that bag order.
    """
    kjt, grad = stacked.features, stacked.grad
    if not isinstance(kjt, KeyedJaggedTensor) or not isinstance(grad, jax.Array | np.ndarray):
        raise NotImplementedError(
            f"gradient accumulation merges the micro-batch calls of the sharded collection at "
            f"{path}, which needs a KeyedJaggedTensor and one pooled output gradient "
            f"[B, D]; got {type(kjt).__name__} and {type(grad).__name__} (sharded sequence "
            "collections are not supported: train them without accumulation)"
        )
    k, world = kjt.lengths().shape[:2]
    b = kjt.stride()
    if grad.ndim != 3 or grad.shape[:2] != (k, world * b):
        raise NotImplementedError(
            f"the sharded collection at {path}: expected a pooled output gradient "
            f"[{k}, {world * b}, D], got {grad.shape}"
        )
    per_device = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), kjt)  # [world, k, ...]
    merged = jax.vmap(concat_bags)(per_device)
    g = grad.reshape(k, world, b, grad.shape[-1]).transpose(1, 0, 2, 3)
    g = g.reshape(world * k * b, grad.shape[-1]) * jnp.asarray(scale, grad.dtype)
    return LookupGrad(merged, g)


def concat_bags(stacked: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``k`` KJTs (leaves ``[k, ...]``, one layout) as one of ``k * stride`` bags per key.

    Key ``f``'s bags are micro-batch 0's, then 1's, ...; its ids are packed at the
    start of a capacity ``k * capacity_f`` (the padding, as any KJT's, is zero).
    Traceable: positions come from the lengths, no host copy.
    """
    stacked.require_uniform_stride("gradient accumulation of a sharded collection's calls")
    children, _ = stacked.tree_flatten()
    values, lengths, weights = children[:3]
    keys, caps, stride = stacked.keys(), stacked.capacity_per_key(), stacked.stride()
    k, f = lengths.shape[0], len(keys)
    per_key = lengths.reshape(k, f, stride).sum(axis=2)  # [k, F] ids of key f in micro-batch i
    start = jnp.cumsum(per_key, axis=0) - per_key  # [k, F] where micro-batch i's ids go
    key_of = np.repeat(np.arange(f), caps)  # [C] the key of each value slot
    offsets = np.cumsum([0, *caps])[:-1]
    pos = np.arange(sum(caps)) - offsets[key_of]  # [C] slot within its key
    dst = k * offsets[key_of] + start[:, key_of] + pos  # [k, C] slot in the merged buffer
    dst = jnp.where(pos < per_key[:, key_of], dst, k * sum(caps)).reshape(-1)

    def scatter(x):
        flat = x.reshape(k * x.shape[1], *x.shape[2:])
        return jnp.zeros_like(flat).at[dst].set(flat, mode="drop")

    merged_lengths = lengths.reshape(k, f, stride).transpose(1, 0, 2).reshape(f * k * stride)
    return KeyedJaggedTensor.from_parts(
        keys,
        scatter(values),
        merged_lengths,
        None if weights is None else scatter(weights),
        capacities=[k * c for c in caps],
        stride=k * stride,
    )


def _merge_checks(checks: dict) -> dict:
    """``where -> (count, example)`` summed over micro-batches (example: the first failing
    micro-batch's)."""
    out = {}
    for where, (counts, examples) in checks.items():
        first = jnp.argmax(counts > 0)
        out[where] = (jnp.sum(counts), examples[first])
    return out


def _merge_warned(warned: tuple) -> tuple:
    """A StepReport's ``(warnings, overflow, counts)`` summed over micro-batches."""
    warnings, overflow, counts = warned
    warnings = _merge_checks(warnings)
    overflow = {key: jnp.sum(c) for key, c in overflow.items()}
    return warnings, overflow, None if counts is None else jnp.sum(counts, axis=0)
