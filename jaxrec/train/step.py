"""The sparse train step: dense grads by autodiff, table rows by the fused sparse path.

The step never forms d loss / d table (a dense ``[rows, dim]`` scatter). It
differentiates the loss with respect to the dense params and to a zero probe
added to every embedding collection's output (``forward.py``, ``jaxrec.embedding.tape``),
then hands each collection its calls' output gradients: the collection maps
them to per-id row gradients, sums duplicate ids and applies each table's
fused optimizer to the touched rows of its donated buffer
(``table_update.py``). Rows a module re-initialised during the forward
(managed-collision evictions, see ``jaxrec.embedding.reset``) keep their fresh
weights and get fresh optimizer state before that update. A step whose
``FATAL`` bounds check failed, or (opt-in) whose loss or gradients are not
finite, applies nothing (see ``guard.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias, cast

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ..embedding.optimizer import CombinedOptimizer, CombinedOptState
from ..embedding.tables import EmbeddingTable
from ..ops import Implementation
from . import guard
from .forward import Forward, differentiate
from .guard import BoundsCheckError, CapacityOverflowError, StepReport
from .step_warnings import StepWarnings
from .table_update import apply_sparse_gradients

# ``loss_fn(model, batch) -> loss`` (a scalar), or ``(loss, aux)`` with ``has_aux=True``;
# the batch and aux are any pytrees (KeyedJaggedTensors, arrays, ...), as in JAX.
LossFn: TypeAlias = Callable[[nnx.Module, Any], Any]


class TrainState(NamedTuple):
    """Everything a step reads and writes (a pytree; donated to the step)."""

    params: nnx.State  # nnx.Param variables
    tables: nnx.State  # EmbeddingTable buffers
    rest: nnx.State  # every other variable (batch stats, rng counters, ...)
    opt_state: CombinedOptState


def init_train_state(
    model: nnx.Module, optimizer: CombinedOptimizer
) -> tuple[nnx.GraphDef, TrainState]:
    """Splits ``model`` into its graph definition and a :class:`TrainState`."""
    graphdef, params, tables, rest = nnx.split(model, nnx.Param, EmbeddingTable, ...)
    return graphdef, TrainState(params, tables, rest, optimizer.init(model))


def merge_model(graphdef: nnx.GraphDef, state: TrainState) -> nnx.Module:
    """The model with the state's current values."""
    return nnx.merge(graphdef, state.params, state.tables, state.rest)


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: CombinedOptimizer,
    loss_fn: LossFn,
    *,
    has_aux: bool = False,
    donate: bool = True,
    implementation: Implementation = None,
    skip_nonfinite: bool = False,
) -> TrainStep:
    """Builds a jitted train step ``step(state, batch) -> (state, loss, aux)``.

    Checks that warn (``BoundsCheckMode.WARNING``, the default, and sharded
    collections built with ``overflow="warn"``) are outputs of the step's program,
    not host callbacks (the program then compiles without a live backend, e.g.
    deviceless for a GPU). The host logs them on the ``jaxrec`` logger with the
    text of a plain module call, once per step, when their counts are ready: at
    the latest two steps later, so no step waits for the one just launched.
    ``step.flush_warnings()`` logs the rest (see ``step_warnings.py``).

    Returns:
        a :class:`TrainStep`: ``step(state, batch) -> (state, loss, aux)``.

    Args:
        graphdef: from :func:`init_train_state`.
        optimizer: dense optax transformation + sparse optimizers.
        loss_fn: ``loss_fn(model, batch) -> loss`` (or ``(loss, aux)`` with
            ``has_aux``). The model may call its embedding collections anywhere,
            any number of times (gradients of every call are summed).
        donate: donate the state (tables and optimizer state update in place).
        implementation: the fused backward + update of unsharded tables: ``None``
            (the C++ kernel on CPU, the Pallas kernel on GPU, XLA elsewhere),
            ``"xla"``, ``"cpu"`` or ``"pallas"`` (on CPU: the Pallas interpreter,
            slow, for tests). Arguments the
            kernel does not support fall back to XLA.
        skip_nonfinite: when the loss, a dense gradient or an embedding output
            gradient is NaN or inf, apply nothing: params, tables, optimizer
            states (step counters included) and ``rest`` stay bit-identical, and
            ``step.skipped_steps()`` counts the step (the loss is still
            returned). Off by default: the step then applies every update as
            before (no check, no select); a skip hides a data error unless
            someone reads the count, and the check adds a pass over the dense
            and output gradients plus selects over the dense state. Turn it on for long
            jobs (``jaxrec-train-dlrm`` does and reports the count), where one
            bad batch would otherwise leave NaN in the touched rows and in
            Adagrad / Adam state for good. Tables are not copied: the skipped
            sparse update runs with no valid id (see ``jaxrec.train.guard``).

    Raises:
        CapacityOverflowError: a sharded collection built with ``overflow="raise"``
            (the default) dropped row-wise ids for lack of capacity in this step.
        BoundsCheckError: a collection with ``BoundsCheckMode.FATAL`` looked up
            out-of-range ids; the step applied nothing and ``err.state`` is the
            unchanged (valid) state. Only then does a step wait for its result.

    Example:
        >>> graphdef, state = init_train_state(model, optimizer)
        >>> step = make_train_step(graphdef, optimizer, loss_fn)
        >>> state, loss, _ = step(state, batch)
    """

    step = functools.partial(
        _step, graphdef, optimizer, loss_fn, has_aux, implementation, skip_nonfinite
    )
    return TrainStep(jax.jit(step, donate_argnums=(0,) if donate else ()))


def _step(graphdef, optimizer, loss_fn, has_aux, implementation, skip_nonfinite, state, batch):
    """One step, traced under ``jit``: ``(state, loss, aux, StepReport)``."""
    fwd = differentiate(graphdef, loss_fn, has_aux, state, batch)
    new, report = apply_forward(optimizer, state, fwd, implementation, skip_nonfinite)
    return new, fwd.loss, fwd.aux, report


def apply_forward(
    optimizer: CombinedOptimizer,
    state: TrainState,
    fwd: Forward,
    implementation: Implementation,
    skip_nonfinite: bool,
) -> tuple[TrainState, StepReport]:
    """The update half of a step, traced under ``jit``: the dense optax update from
    ``fwd.g_params`` and every collection's fused sparse update from ``fwd.calls``
    (masked as ``guard.py`` says). ``(new state, StepReport)``."""
    updates, dense_state = optimizer.dense.update(fwd.g_params, state.opt_state.dense, state.params)
    params = cast(nnx.State, optax.apply_updates(state.params, updates))  # same pytree type
    tables, rest, calls, resets = fwd.tables, fwd.rest, fwd.calls, fwd.resets
    g_outputs = [c.lookup.grad for c in calls]
    ok = guard.apply_mask(fwd.loss, fwd.g_params, g_outputs, fwd.fatal, skip_nonfinite)
    if ok is not None:  # skip by masking: only small things are selected (see guard.py)
        params = optax.tree.where(ok, params, state.params)
        dense_state = optax.tree.where(ok, dense_state, state.opt_state.dense)
        rest = optax.tree.where(ok, rest, state.rest)
        tables, resets, calls = guard.mask_sparse_inputs(ok, tables, resets, calls)
    sparse_state = state.opt_state.sparse
    for r in resets:  # fresh optimizer rows for re-initialised table rows, before the update
        sparse_state = r.module.reset_optimizer_rows(
            optimizer, r.path, r.group, sparse_state, r.rows
        )
    tables, sparse_state = apply_sparse_gradients(
        optimizer, tables, sparse_state, calls, fwd.loss, implementation
    )
    if ok is not None:
        sparse_state = guard.keep_counts(sparse_state, state.opt_state.sparse, ok)
    new = TrainState(params, tables, rest, CombinedOptState(dense_state, sparse_state))
    skipped = None if ok is None else jnp.logical_not(ok)
    return new, StepReport(fwd.dropped, skipped, fwd.fatal, *fwd.warned)


class TrainStep:
    """A jitted train step: ``step(state, batch) -> (state, loss, aux)``.

    Calling it runs :attr:`jitted` and handles its :class:`~jaxrec.train.guard.StepReport`:
    counts skipped steps, logs warnings once their counts are ready, raises
    ``BoundsCheckError`` / ``CapacityOverflowError``. ``TrainPipeline`` runs
    :attr:`jitted` itself (reading each report one step late) and hands the
    reports to :meth:`record`.

    Attributes:
        jitted: the ``jax.jit`` function ``(state, batch) -> (state, loss, aux, StepReport)``.
        skipped_steps: ``() -> int``, the steps that applied nothing so far.
        step_warnings: the :class:`StepWarnings` of pending warnings.
    """

    def __init__(self, jitted: jax.stages.Wrapped):
        self.jitted = jitted
        self.skipped_steps = guard.SkipCounter()
        self.step_warnings = StepWarnings()

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, jax.Array, Any]:
        new, loss, aux, report = self.jitted(state, batch)
        self.handle(report, new)
        return new, loss, aux

    def handle(self, report: StepReport, new: TrainState) -> None:
        """Records a step's report and raises what it calls for (``new``: the step's state)."""
        self.record(report)
        try:
            guard.raise_for_report(report, new)
        except (BoundsCheckError, CapacityOverflowError):
            self.flush_warnings()  # the step has finished: log what it found before raising
            raise

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The lowered program (``jax.jit(...).lower``), for inspection."""
        return self.jitted.lower(*args, **kwargs)

    def record(self, report: StepReport) -> None:
        """Counts a step's skipped flag and queues its warnings (no host sync)."""
        self.skipped_steps.add(report.skipped)
        self.step_warnings.add(report)

    def flush_warnings(self) -> None:
        """Logs every pending warning (waits for the steps that hold them)."""
        self.step_warnings.flush()


def make_eval_step(
    graphdef: nnx.GraphDef, fn: Callable[[nnx.Module, Any], Any]
) -> Callable[[TrainState, Any], Any]:
    """Jitted ``fn(model, batch)`` over a :class:`TrainState` (no update, no donation)."""
    return jax.jit(lambda state, batch: fn(merge_model(graphdef, state), batch))
