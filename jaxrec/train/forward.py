"""The differentiated forward of a train step: the loss, dense gradients, and every
embedding collection call with the gradient of its output (see ``jaxrec.embedding.tape``)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..embedding.collection import LookupGrad
from ..embedding.tables import EmbeddingTable
from ..embedding.tape import Reset, Tape
from . import guard
from .table_update import CollectionCall


class Given(NamedTuple):
    """Collection outputs looked up a step earlier (a semi-synchronous step, see
    ``semi_sync.py``), with the bounds checks found by that lookup."""

    outputs: list  # one pytree per collection call, in call order
    fatal: dict  # where -> (count, example) of FATAL checks (guard.merge_reports)
    warning: dict  # the same for WARNING checks


_GIVEN: contextvars.ContextVar[Given | None] = contextvars.ContextVar(
    "jaxrec_given_outputs", default=None
)


@contextlib.contextmanager
def given_outputs(given: Given) -> Iterator[None]:
    """Within it, :func:`differentiate` replaces the i-th collection call's output by
    ``given.outputs[i]``, so that the gradients are with respect to those outputs, and
    reports ``given``'s bounds checks instead of its own: its own lookups are then dead
    code, which XLA removes."""
    token = _GIVEN.set(given._replace(outputs=list(given.outputs)))
    try:
        yield
    finally:
        _GIVEN.reset(token)


class Forward(NamedTuple):
    """What differentiating the loss once found."""

    loss: jax.Array
    aux: Any
    g_params: nnx.State  # d loss / d params
    tables: nnx.State  # as the forward left them: evicted rows re-initialised
    rest: nnx.State  # the other variables after the forward
    calls: list[CollectionCall]  # every collection call, in call order
    resets: list[Reset]  # rows re-initialised during the forward (see embedding/reset.py)
    dropped: jax.Array | None  # row-wise ids dropped for capacity (overflow="raise")
    fatal: dict  # where -> (count, example) of FATAL bounds checks
    warned: tuple  # (warnings, overflow, counts) of a StepReport


def differentiate(
    graphdef: nnx.GraphDef, loss_fn: Callable, has_aux: bool, state: Any, batch: Any
) -> Forward:
    """Runs ``loss_fn`` on the model of ``state`` under a tape and differentiates it with
    respect to the dense params and a zero probe added to every collection output."""
    probes = _zero_probes(graphdef, state, loss_fn, batch)
    given = _GIVEN.get()  # None but in a semi-synchronous step
    tape_found: list[Tape] = []

    def run(params, probes, tables, rest):  # everything as arguments: nnx may mutate rest
        model = nnx.merge(graphdef, params, tables, rest, copy=True)
        with Tape(model, probes, None if given is None else given.outputs) as tape:
            out = loss_fn(model, batch)
        loss, aux = out if has_aux else (out, None)
        _, _, tables, rest = nnx.split(model, nnx.Param, EmbeddingTable, ...)
        tape_found.append(tape)
        dropped = sum(tape.overflow) if tape.overflow else None
        fatal, warning = guard.merge_reports(tape.fatal), guard.merge_reports(tape.warning)
        if given is not None:  # the checks of the lookup that made the given outputs
            fatal, warning = given.fatal, given.warning
        warned = guard.warned(warning, tape.overflow_warned)
        features = [c.features for c in tape.calls]
        reset_rows = [(r.rows, r.old) for r in tape.resets]
        return loss, (aux, features, tables, rest, reset_rows, dropped, fatal, warned)

    grad_fn = jax.value_and_grad(run, argnums=(0, 1), has_aux=True)
    (loss, found), (g_params, g_probes) = grad_fn(state.params, probes, state.tables, state.rest)
    aux, features, tables, rest, reset_rows, dropped, fatal, warned = found
    (tape,) = tape_found
    calls = [
        CollectionCall(c.path, c.module, LookupGrad(f, g))
        for c, f, g in zip(tape.calls, features, g_probes, strict=True)
    ]
    resets = [
        dataclasses.replace(r, rows=rows, old=old)  # the values out of the differentiated trace
        for r, (rows, old) in zip(tape.resets, reset_rows, strict=True)
    ]
    return Forward(loss, aux, g_params, tables, rest, calls, resets, dropped, fatal, warned)


def _zero_probes(graphdef, state, loss_fn, batch) -> list:
    """Zero probes shaped like every collection call's output (shape-only trace)."""
    shapes: list = []

    def forward(params, tables, rest):
        model = nnx.merge(graphdef, params, tables, rest, copy=True)
        with Tape(model) as tape:
            loss_fn(model, batch)
        shapes.extend(c.shapes for c in tape.calls)
        return 0

    jax.eval_shape(forward, state.params, state.tables, state.rest)
    return [jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sh) for sh in shapes]
