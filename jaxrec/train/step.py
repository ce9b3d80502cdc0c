"""The sparse train step: dense grads by autodiff, table rows by the fused sparse path.

The step never forms d loss / d table (a dense ``[rows, dim]`` scatter). It
differentiates the loss with respect to the dense params and to a zero probe
added to every embedding collection's output (see ``tape.py``), maps each
probe gradient to per-id row gradients, sums duplicate ids and applies each
table's fused optimizer to the touched rows of its donated buffer. Rows a
module re-initialised during the forward (managed-collision evictions, see
``reset.py``) keep their fresh weights and get fresh optimizer state before
that update. A step whose ``FATAL`` bounds check failed, or (opt-in) whose loss
or gradients are not finite, applies nothing (see ``guard.py``).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ..embedding.optimizer import CombinedOptimizer, CombinedOptState, state_key
from ..embedding.reset import reset_optimizer_rows
from ..embedding.sparse_update import backward_update, update_subgroup
from ..embedding.tables import EmbeddingTable
from ..embedding.tape import Tape
from ..ops.dispatch import try_cpu
from ..xla.backward import dedup_rows, pooled_grad_sources, sequence_grad_sources, source_grads
from . import guard
from .guard import BoundsCheckError, StepReport
from .step_warnings import StepWarnings


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
    loss_fn: Callable[[nnx.Module, Any], Any],
    *,
    has_aux: bool = False,
    donate: bool = True,
    implementation: str | None = None,
    skip_nonfinite: bool = False,
) -> Callable[[TrainState, Any], tuple[TrainState, jax.Array, Any]]:
    """Builds a jitted train step ``step(state, batch) -> (state, loss, aux)``.

    Checks that warn (``BoundsCheckMode.WARNING``, the default, and sharded
    collections built with ``overflow="warn"``) are outputs of the step's program,
    not host callbacks (the program then compiles without a live backend, e.g.
    deviceless for a GPU). The host logs them on the ``jaxrec`` logger with the
    text of a plain module call, once per step, when their counts are ready: at
    the latest two steps later, so no step waits for the one just launched.
    ``step.flush_warnings()`` logs the rest (see ``step_warnings.py``).

    Args:
        graphdef: from :func:`init_train_state`.
        optimizer: dense optax transformation + sparse optimizers.
        loss_fn: ``loss_fn(model, batch) -> loss`` (or ``(loss, aux)`` with
            ``has_aux``). The model may call its embedding collections anywhere,
            any number of times (gradients of every call are summed).
        donate: donate the state (tables and optimizer state update in place).
        implementation: the fused backward + update of unsharded tables: ``None``
            (the Pallas kernel on GPU, XLA elsewhere), ``"xla"`` or ``"pallas"``
            (on CPU: the Pallas interpreter, slow, for tests). Arguments the
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

    def step(state: TrainState, batch: Any):
        probes, _ = _probe_shapes(graphdef, state, loss_fn, batch)

        def run(params, probes, tables, rest):  # everything as arguments: nnx may mutate rest
            model = nnx.merge(graphdef, params, tables, rest, copy=True)
            with Tape(model, probes) as tape:
                out = loss_fn(model, batch)
            loss, aux = out if has_aux else (out, None)
            _, _, tables, rest = nnx.split(model, nnx.Param, EmbeddingTable, ...)
            calls.extend((c.path, c.module) for c in tape.calls)
            resets.extend((r.path, r.module, r.group) for r in tape.resets)
            dropped = sum(tape.overflow) if tape.overflow else None
            reset_rows = [(r.rows, r.old) for r in tape.resets]
            fatal = guard.merge_reports(tape.fatal)
            warned = guard.warned(guard.merge_reports(tape.warning), tape.overflow_warned)
            features = [c.features for c in tape.calls]
            return loss, (aux, features, tables, rest, reset_rows, dropped, fatal, warned)

        calls: list = []
        resets: list = []  # (path, collection, group) of rows re-initialised in the forward
        grad_fn = jax.value_and_grad(run, argnums=(0, 1), has_aux=True)
        (loss, found), (g_params, g_probes) = grad_fn(
            state.params, probes, state.tables, state.rest
        )
        aux, features, tables, rest, reset_rows, dropped, fatal, warned = found
        updates, dense_state = optimizer.dense.update(g_params, state.opt_state.dense, state.params)
        params = optax.apply_updates(state.params, updates)
        sparse_state = state.opt_state.sparse
        ok = guard.apply_mask(loss, g_params, g_probes, fatal, skip_nonfinite)
        if ok is not None:  # skip by masking: only small things are selected (see guard.py)
            params = optax.tree.where(ok, params, state.params)
            dense_state = optax.tree.where(ok, dense_state, state.opt_state.dense)
            rest = optax.tree.where(ok, rest, state.rest)
            tables = _undo_resets(tables, resets, reset_rows, ok)
            reset_rows = [
                (guard.no_reset_rows(module, group, rows, ok), old)
                for (_, module, group), (rows, old) in zip(resets, reset_rows, strict=True)
            ]
            features = [guard.without_ids(f, ok) for f in features]
        for (path, module, group), (rows, _) in zip(resets, reset_rows, strict=True):
            sparse_state = reset_optimizer_rows(optimizer, module, path, group, sparse_state, rows)
        tables, sparse_state = _sparse_update(
            optimizer,
            tables,  # as the forward left them: evicted rows re-initialised
            sparse_state,
            calls,
            features,
            g_probes,
            loss,
            implementation,
        )
        if ok is not None:
            sparse_state = guard.keep_counts(sparse_state, state.opt_state.sparse, ok)
        new = TrainState(params, tables, rest, CombinedOptState(dense_state, sparse_state))
        skipped = None if ok is None else jnp.logical_not(ok)
        return new, loss, aux, StepReport(dropped, skipped, fatal, *warned)

    jitted = jax.jit(step, donate_argnums=(0,) if donate else ())
    skipped_steps = guard.SkipCounter()
    step_warnings = StepWarnings()

    def train_step(state: TrainState, batch: Any):
        new, loss, aux, report = jitted(state, batch)
        skipped_steps.add(report.skipped)
        step_warnings.add(report)
        try:
            raise_for_report(report, new)
        except (BoundsCheckError, CapacityOverflowError):
            step_warnings.flush()  # the step has finished: log what it found before raising
            raise
        return new, loss, aux

    train_step.lower = jitted.lower  # for inspecting the compiled program
    train_step.jitted = jitted  # returns (state, loss, aux, StepReport); see TrainPipeline
    train_step.skipped_steps = skipped_steps  # () -> steps skipped so far
    train_step.step_warnings = step_warnings  # StepWarnings (shared with TrainPipeline)
    train_step.flush_warnings = step_warnings.flush  # () -> logs every pending warning
    return train_step


def raise_for_report(report: StepReport, state: TrainState) -> None:
    """Raises the error a step's report calls for, with ``state`` (a host sync only when
    the step has FATAL checks or can drop ids)."""
    if report.fatal:
        failures = guard.fatal_failures(report.fatal)
        if failures:
            raise BoundsCheckError(failures, state)
    if report.dropped is not None and int(report.dropped) > 0:
        raise CapacityOverflowError(int(report.dropped), state)


class CapacityOverflowError(RuntimeError):
    """A sharded collection dropped ids that did not fit its per-destination capacity.

    The step was applied without them; ``state`` is the state after it (the
    input state was donated).
    """

    def __init__(self, dropped: int, state: TrainState):
        super().__init__(
            f"row-wise input_dist dropped {dropped} ids that did not fit the per-destination "
            "capacity in this step; pass a larger capacity= to DistributedModelParallel "
            "(or overflow='warn' / 'count' to train on and count them in overflow_count)"
        )
        self.dropped = dropped
        self.state = state


def make_eval_step(
    graphdef: nnx.GraphDef, fn: Callable[[nnx.Module, Any], Any]
) -> Callable[[TrainState, Any], Any]:
    """Jitted ``fn(model, batch)`` over a :class:`TrainState` (no update, no donation)."""
    return jax.jit(lambda state, batch: fn(merge_model(graphdef, state), batch))


def _probe_shapes(graphdef, state, loss_fn, batch):
    """Zero probes shaped like every collection call's output (shape-only trace)."""
    shapes: list = []

    def forward(params, tables, rest):
        model = nnx.merge(graphdef, params, tables, rest, copy=True)
        with Tape(model) as tape:
            loss_fn(model, batch)
        shapes.extend(c.shapes for c in tape.calls)
        return 0

    jax.eval_shape(forward, state.params, state.tables, state.rest)
    probes = [jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sh) for sh in shapes]
    return probes, shapes


def _grad_sources(module, features, g):
    """``(group, out_grad [S, D], seg, scale, rows, valid)`` per table group of one call.

    Id ``c`` of the group gets gradient ``out_grad[seg[c]] * scale[c]`` (see
    ``pooled_grad_sources``); nothing per-id is formed here.
    """
    out = []
    pooled = hasattr(module, "output_columns")
    cols = module.output_columns() if pooled else None
    for grp in module.groups:
        if pooled:
            gg = jnp.stack([g[:, cols[o] : cols[o + 1]] for o in grp.outputs], axis=1)
            flat = gg.reshape(gg.shape[0] * gg.shape[1], -1)
            src = pooled_grad_sources(features, grp.slots, is_weighted=module.is_weighted())
        else:
            flat = jnp.concatenate([g[o] for o in grp.outputs])
            src = sequence_grad_sources(features, grp.slots)
        rows, seg, scale, valid = src
        out.append((grp, flat, seg, scale, rows, valid))
    return out


def _table_leaves(tables):
    """``(leaves, index, treedef)``: ``index[(*module_path, "weights", group)]`` is a leaf's."""
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tables)
    index = {
        tuple(k.key for k in p if hasattr(k, "key")): i for i, (p, _) in enumerate(leaves_with_path)
    }
    return [leaf for _, leaf in leaves_with_path], index, treedef


def _undo_resets(tables, resets, reset_rows, ok):
    leaves, index, treedef = _table_leaves(tables)
    guard.undo_resets(leaves, index, resets, reset_rows, ok)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _sparse_update(
    optimizer, tables, sparse_state, calls, features, g_probes, loss, implementation
):
    leaves, index, treedef = _table_leaves(tables)
    sparse_state = dict(sparse_state)
    # A data dependency of every row update on the loss orders the forward's
    # table reads before the in-place scatters. Without it, when the output
    # gradient does not depend on the looked-up rows (a linear head), XLA:CPU
    # copies each table (2 GB for 4M x 128) to keep the old one alive; an
    # optimization_barrier does not prevent that. The where() keeps a non-finite
    # loss from turning updates into NaN.
    finite_loss = jnp.where(jnp.isfinite(loss), loss, 0.0)
    pending: dict = defaultdict(list)
    raw: dict = defaultdict(list)  # (features, output gradient) of each call
    owners: dict = {}
    seen_sharded = set()
    for (path, module), feats, g in zip(calls, features, g_probes, strict=True):
        if hasattr(module, "sparse_update"):  # a sharded collection updates its own shards
            if path in seen_sharded:
                raise NotImplementedError(
                    f"the sharded collection at {path} was called twice in one step"
                )
            seen_sharded.add(path)
            names = list(module.weights)
            current = {n: leaves[index[(*path, "weights", n)]] for n in names}
            new, sparse_state = module.sparse_update(
                optimizer,
                path,
                current,
                sparse_state,
                feats,
                jax.tree.map(lambda x: x + 0.0 * finite_loss, g),
            )
            for n in names:
                leaves[index[(*path, "weights", n)]] = new[n]
            continue
        for grp, *src in _grad_sources(module, feats, g):
            pending[(path, grp.name)].append(src)
            raw[(path, grp.name)].append((feats, g))
            owners[(path, grp.name)] = (module, grp)
    for (path, name), parts in pending.items():
        module, grp = owners[(path, name)]
        i = index[(*path, "weights", name)]
        subs = optimizer.subgroups(module, grp)
        fused = len(subs) == 1 and subs[0].covers_group  # one optimizer: the fused path
        key = state_key(path, name, 0)
        if fused:
            flat, seg, scale, rows, valid = _concat_sources(parts)

            generic = functools.partial(
                backward_update,
                subs[0].optimizer,
                leaves[i],
                sparse_state[key],
                flat + 0.0 * finite_loss,  # see above
                seg,
                scale,
                rows,
                valid,
                implementation=implementation,
            )
            if len(parts) == 1 and hasattr(module, "output_columns"):
                # One pooled call: where the program runs on CPU, the C++ kernel
                # reads the KJT and the output gradient directly (the sources
                # traced above are then dead code, which XLA drops).
                (feats, g), cols = raw[(path, name)][0], module.output_columns()
                leaves[i], sparse_state[key] = try_cpu(
                    "kjt_backward_update",
                    implementation,
                    generic,
                    subs[0].optimizer,
                    leaves[i],
                    sparse_state[key],
                    g,
                    feats,
                    grp.slots,
                    tuple(cols[o] for o in grp.outputs),
                    is_weighted=module.is_weighted(),
                    dep=finite_loss,
                )
            else:
                leaves[i], sparse_state[key] = generic()
            continue
        flat, seg, scale, rows, valid = _concat_sources(parts)
        flat = flat + 0.0 * finite_loss  # see above
        unique, summed = dedup_rows(
            rows, source_grads(flat, seg, scale, valid), valid, grp.num_rows
        )
        for k, sub in enumerate(subs):
            key = state_key(path, name, k)
            leaves[i], sparse_state[key] = update_subgroup(
                sub,
                grp.row_offsets,
                leaves[i],
                sparse_state[key],
                unique,
                summed,
                implementation=implementation,
            )
    return jax.tree_util.tree_unflatten(treedef, leaves), sparse_state


def _concat_sources(parts):
    """One gradient description from several calls' (output rows offset per call)."""
    if len(parts) == 1:
        return parts[0]
    offsets = np.cumsum([0] + [p[0].shape[0] for p in parts[:-1]])
    flat = jnp.concatenate([p[0] for p in parts])
    seg = jnp.concatenate([p[1] + int(o) for p, o in zip(parts, offsets, strict=True)])
    rest = (jnp.concatenate(x) for x in list(zip(*parts, strict=True))[2:])
    return (flat, seg, *rest)
