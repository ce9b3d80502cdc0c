"""The pipelined train step: step ``i`` consumes ids sent by step ``i - 1`` and sends batch
``i + 1``'s (TorchRec's ``TrainPipelineSparseDist``, in one program per step).

``step(state, ids_i, batch_i, batch_next) -> (state, loss, aux, report, ids_next)``:
the sharded collections skip round 0 of their id exchange (it arrived with
``ids_i``, see ``jaxrec.distributed.input_dist``), and the same program sends
``batch_next``'s ids. Nothing of step ``i`` reads ``ids_next``, so the
``all_to_all`` that makes it is free to run beside step ``i``'s compute (on
GPUs XLA makes it asynchronous: ``all-to-all-start`` ... ``all-to-all-done``).
Everything else, the exact overflow rounds included, is the unpipelined
step's (``step.py``), on the same ids: the results are the same.

The ids must depend on the batch alone: ids that a feature processor's
parameters or a managed-collision remapping (model state) produce before a
sharded collection would be sent with the previous step's state. The step
checks this when it traces and raises ``ValueError``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jcore
from flax import nnx

from ..distributed import input_dist
from ..embedding.optimizer import CombinedOptimizer
from ..embedding.tape import Tape
from ..ops import Implementation
from .step import LossFn, TrainState, TrainStep, _step

AHEAD_SCOPE = "input_dist_ahead"


def make_sparse_dist_train_step(
    graphdef: nnx.GraphDef,
    optimizer: CombinedOptimizer,
    loss_fn: LossFn,
    *,
    has_aux: bool = False,
    donate: bool = True,
    implementation: Implementation = None,
    skip_nonfinite: bool = False,
) -> SparseDistTrainStep:
    """:func:`~jaxrec.train.make_train_step` with the input distribution one step ahead.

    Arguments as ``make_train_step``'s. Run it with
    :class:`~jaxrec.train.TrainPipelineSparseDist`, or by hand::

        ids = step.input_dist(state, batches[0])
        for batch, after in zip(batches, batches[1:] + batches[-1:]):
            state, loss, _, ids = step(state, ids, batch, after)

    (the last step distributes its own batch again, unused: one program for all).

    Returns:
        a :class:`SparseDistTrainStep`.
    """
    body = functools.partial(
        _step, graphdef, optimizer, loss_fn, has_aux, implementation, skip_nonfinite
    )
    ahead = functools.partial(distribute_ahead, graphdef, loss_fn)
    run = functools.partial(_pipelined, body, ahead)
    return SparseDistTrainStep(jax.jit(run, donate_argnums=(0,) if donate else ()), jax.jit(ahead))


def _pipelined(body, ahead, state, ids, batch, next_batch):
    with input_dist.feeding(ids):
        new, loss, aux, report = body(state, batch)
    with jax.named_scope(AHEAD_SCOPE):  # names its ops in the compiled program (op_name)
        next_ids = ahead(state, next_batch)
    return new, loss, aux, report, next_ids


class SparseDistTrainStep(TrainStep):
    """A pipelined train step: ``step(state, ids, batch, next_batch) -> (state, loss, aux,
    next_ids)``.

    Attributes:
        jitted: ``(state, ids, batch, next_batch) -> (state, loss, aux, StepReport, next_ids)``.
        input_dist: jitted ``(state, batch) -> ids``, the first batch's distribution.
    """

    def __init__(self, jitted: jax.stages.Wrapped, input_dist: jax.stages.Wrapped):
        super().__init__(jitted)
        self.input_dist = input_dist

    def __call__(self, state: TrainState, ids: dict, batch: Any, next_batch: Any) -> tuple:
        new, loss, aux, report, next_ids = self.jitted(state, ids, batch, next_batch)
        self.handle(report, new)
        return new, loss, aux, next_ids


def distribute_ahead(
    graphdef: nnx.GraphDef, loss_fn: Callable, state: TrainState, batch: Any
) -> dict:
    """Round 0 of every sharded collection call's id exchange for ``batch`` (traced: runs the
    model in recording mode; everything but the exchange is dead code)."""
    record = functools.partial(_record, graphdef, loss_fn)
    closed, shapes = jax.make_jaxpr(record, return_shape=True)(state, batch)
    n_state = len(jax.tree.leaves(state))
    tainted = _tainted(closed.jaxpr, [i < n_state for i in range(len(closed.jaxpr.invars))])
    paths = [p[0].key for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    bad = sorted({p for p, t in zip(paths, tainted, strict=True) if t})  # collection paths
    if bad:
        raise ValueError(
            f"the ids reaching sharded collections {bad} depend on the model's state (a "
            "feature processor's parameters, a managed-collision remapping, ...), not on the "
            "batch alone, so they cannot be distributed a step ahead; use TrainPipeline"
        )
    flat = jcore.jaxpr_as_fun(closed)(*jax.tree.leaves((state, batch)))
    return jax.tree.unflatten(jax.tree.structure(shapes), flat)


def _record(graphdef, loss_fn, state, batch):
    model = nnx.merge(graphdef, state.params, state.tables, state.rest, copy=True)
    with Tape(model), input_dist.recording() as found:
        loss_fn(model, batch)
    return found


def _tainted(jaxpr: jcore.Jaxpr, tainted_in: list[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` depend on the inputs marked in ``tainted_in`` (a nested
    call with matching arity is followed; loops, whose carries feed back, and any other
    equation taint all their outputs)."""
    tainted = {v for v, t in zip(jaxpr.invars, tainted_in, strict=True) if t}

    def hit(v):
        return isinstance(v, jcore.Var) and v in tainted

    for eqn in jaxpr.eqns:
        ins = [hit(v) for v in eqn.invars]
        if not any(ins):
            continue
        subs = list(jcore.jaxprs_in_params(eqn.params))
        sub = subs[0] if len(subs) == 1 and eqn.primitive.name != "scan" else None
        if sub is not None and (len(sub.invars), len(sub.outvars)) == (
            len(eqn.invars),
            len(eqn.outvars),
        ):
            outs = _tainted(sub, ins)
        else:
            outs = [True] * len(eqn.outvars)
        tainted.update(v for v, t in zip(eqn.outvars, outs, strict=True) if t)
    return [hit(v) for v in jaxpr.outvars]
