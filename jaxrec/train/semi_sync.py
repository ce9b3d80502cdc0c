"""The semi-synchronous train step: step ``i`` trains the dense part on batch ``i``'s
embeddings, looked up by step ``i - 1``, and looks up batch ``i + 1``'s (TorchRec's
``TrainPipelineSemiSync``, in one program per step).

``step(state, looked_up_i, batch_i, batch_next) -> (state, loss, aux, report,
looked_up_next)``, where a :class:`LookedUp` holds a batch's collection outputs
and the bounds checks of their lookup:

1. the lookup of ``batch_next``: the loss function runs with a recording tape
   (``jaxrec.embedding.tape``) and every collection call's output is kept; the
   dense part of that run is dead code, which XLA removes;
2. the forward and backward of ``batch_i`` (``step.py``'s, unchanged), with the
   k-th collection call's output replaced by ``looked_up_i.outputs[k]``
   (``forward.given_outputs``): dense gradients and the gradient of each output.
   The collections' own lookups of ``batch_i`` are dead code too: the step
   reports (and, under ``BoundsCheckMode.FATAL``, skips on) the bounds checks
   of ``looked_up_i``;
3. the updates: the dense optimizer, and batch ``i``'s sparse gradients applied
   to the rows its ids name, as in the synchronous step.

The lookup of batch ``i + 1`` reads the tables before batch ``i``'s sparse update:
embedding gradients land one step late (staleness 1); dense parameters are not
stale. Nothing of the dense half reads ``looked_up_next``, so the two halves are
free to overlap (on GPUs a sharded lookup's ``all_to_all`` runs beside the dense
compute); only the in-place table update waits for the lookup's reads.

Not supported, refused when the step traces (``ValueError``): collection inputs
that depend on the model's state (a feature processor's parameters would get no
gradient through a replaced output; a managed-collision remapping or a dynamic
table's admission would run a step early), and modules that re-initialise rows
during the forward (managed-collision evictions). Cached tables
(``jaxrec.cache``) load a batch's rows just before its step, too late for a
lookup one step ahead: ``CachedTrainStep`` does not take this step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from flax import nnx

from ..embedding.optimizer import CombinedOptimizer
from ..embedding.tape import Tape
from ..ops import Implementation
from .forward import Given, given_outputs
from .guard import merge_reports
from .sparse_dist_step import _tainted
from .step import LossFn, TrainState, TrainStep, _step

LOOKUP_SCOPE = "semi_sync_lookup"


def make_semi_sync_train_step(
    graphdef: nnx.GraphDef,
    optimizer: CombinedOptimizer,
    loss_fn: LossFn,
    *,
    has_aux: bool = False,
    donate: bool = True,
    implementation: Implementation = None,
    skip_nonfinite: bool = False,
) -> SemiSyncTrainStep:
    """:func:`~jaxrec.train.make_train_step` with the embedding lookup one step ahead.

    Arguments as ``make_train_step``'s. Run it with
    :class:`~jaxrec.train.TrainPipelineSemiSync`, or by hand::

        looked_up = step.lookup(state, batches[0])
        for batch, after in zip(batches, batches[1:] + batches[-1:]):
            state, loss, _, looked_up = step(state, looked_up, batch, after)

    (the last step looks its own batch up again, unused: one program for all).

    Returns:
        a :class:`SemiSyncTrainStep`.
    """
    body = functools.partial(
        _step, graphdef, optimizer, loss_fn, has_aux, implementation, skip_nonfinite
    )
    ahead = functools.partial(lookup_ahead, graphdef, loss_fn)
    run = functools.partial(_semi_sync, body, ahead)
    donated = (0,) if donate else ()
    return SemiSyncTrainStep(
        jax.jit(run, donate_argnums=donated), jax.jit(ahead), jax.jit(body, donate_argnums=donated)
    )


def _semi_sync(body, ahead, state, looked_up, batch, next_batch):
    with jax.named_scope(LOOKUP_SCOPE):  # names its ops in the compiled program (op_name)
        ahead_found = ahead(state, next_batch)
    # The tables are updated in place (donated): the loss, on which every row update
    # depends (table_update.py), takes a zero that depends on the lookup ahead, so the
    # lookup's reads come first; without it XLA:CPU copies each table (twice, for a
    # 200k x 64 table) to keep the old one.
    # A non-finite lookup does not reach the loss (the where).
    leaves = jax.tree.leaves(ahead_found.outputs)
    total = sum((jnp.sum(x, dtype=jnp.float32) for x in leaves), jnp.float32(0))
    zero = 0.0 * jnp.where(jnp.isfinite(total), total, 0.0)
    outputs = jax.tree.map(lambda x: x + zero.astype(x.dtype), list(looked_up.outputs))
    with given_outputs(Given(outputs, looked_up.fatal, looked_up.warning)):
        new, loss, aux, report = body(state, batch)
    return new, loss, aux, report, ahead_found


class LookedUp(NamedTuple):
    """A batch's embeddings looked up a step ahead, handed from step to step."""

    outputs: list  # one pytree per collection call, in call order (the call's output)
    fatal: dict  # where -> (count, example): the lookup's FATAL bounds checks
    warning: dict  # the same for its WARNING checks (logged by the step that trains on it)


class SemiSyncTrainStep(TrainStep):
    """A semi-synchronous train step: ``step(state, looked_up, batch, next_batch) ->
    (state, loss, aux, next_looked_up)``.

    ``looked_up`` is the :class:`LookedUp` of ``batch``, from the step before (or
    from :attr:`lookup`). Its bounds checks are the ones the step reports (and skips
    on, under ``BoundsCheckMode.FATAL``).

    Attributes:
        jitted: ``(state, looked_up, batch, next_batch) -> (state, loss, aux, StepReport,
            next_looked_up)``.
        lookup: jitted ``(state, batch) -> LookedUp``, the first batch's lookup.
        sync: jitted ``(state, batch) -> (state, loss, aux, StepReport)``, the
            synchronous step of the same model (``TrainPipelineSemiSync``'s
            ``start_batch`` warm-up; compiled only if called).
    """

    def __init__(
        self, jitted: jax.stages.Wrapped, lookup: jax.stages.Wrapped, sync: jax.stages.Wrapped
    ):
        super().__init__(jitted)
        self.lookup = lookup
        self.sync = sync

    def __call__(
        self, state: TrainState, looked_up: LookedUp, batch: Any, next_batch: Any
    ) -> tuple:
        new, loss, aux, report, ahead = self.jitted(state, looked_up, batch, next_batch)
        self.handle(report, new)
        return new, loss, aux, ahead


def lookup_ahead(
    graphdef: nnx.GraphDef, loss_fn: Callable, state: TrainState, batch: Any
) -> LookedUp:
    """Every collection call's output for ``batch`` with ``state``'s tables (traced: runs
    the model under a recording tape; everything but the lookups is dead code).

    Returns:
        a :class:`LookedUp`: one output pytree per collection call, in call order,
        shaped like the call's output (``[B, sum(D)]`` pooled values for an
        ``EmbeddingBagCollection``), and the lookups' bounds checks.

    Raises:
        ValueError: a collection's input depends on the model's state, or a module
            re-initialised rows during the forward (see the module docstring).
    """
    paths: list = []
    record = functools.partial(_record, graphdef, loss_fn, paths)
    closed, shapes = jax.make_jaxpr(record, return_shape=True)(state, batch)
    n_state = len(jax.tree.leaves(state))
    tainted = _tainted(closed.jaxpr, [i < n_state for i in range(len(closed.jaxpr.invars))])
    found, features = shapes
    n_out = len(jax.tree.leaves(found))
    keys = [p[0].idx for p, _ in jax.tree_util.tree_flatten_with_path(features)[0]]
    bad = sorted({_name(paths[k]) for k, t in zip(keys, tainted[n_out:], strict=True) if t})
    if bad:
        raise ValueError(
            f"the inputs of the collections at {bad} depend on the model's state (a feature "
            "processor's parameters, a managed-collision remapping, ...), not on the batch "
            "alone: a semi-synchronous step would look them up a step early and give their "
            "parameters no gradient; use make_train_step"
        )
    flat = jcore.jaxpr_as_fun(closed)(*jax.tree.leaves((state, batch)))
    return jax.tree.unflatten(jax.tree.structure(found), flat[:n_out])


def _record(graphdef, loss_fn, paths, state, batch):
    """``(LookedUp, features)`` of every collection call; ``paths`` gets their module paths."""
    model = nnx.merge(graphdef, state.params, state.tables, state.rest, copy=True)
    with Tape(model) as tape:
        loss_fn(model, batch)
    if tape.resets:
        where = sorted({_name(r.path) for r in tape.resets})
        raise ValueError(
            f"the modules at {where} re-initialise table rows during the forward (managed-"
            "collision evictions, dynamic tables): a semi-synchronous step cannot look their "
            "rows up a step ahead; use make_train_step"
        )
    paths[:] = [c.path for c in tape.calls]
    found = LookedUp(
        [c.output for c in tape.calls], merge_reports(tape.fatal), merge_reports(tape.warning)
    )
    return found, [c.features for c in tape.calls]


def _name(path: tuple) -> str:
    """A module path as the dotted attribute name a user writes (``"sparse.ebc"``)."""
    return ".".join(str(p) for p in path)
