"""The sparse-optimizer interface (optax idioms, row-wise).

A sparse optimizer updates only the rows a batch touched. Its state is a
``NamedTuple`` whose first field is an int32 ``count`` (training steps taken,
one counter per table group as in FBGEMM) and whose other fields are per-row
arrays with leading dimension ``num_rows``: ``[rows, dim]`` for element-wise
state, ``[rows]`` for row-wise state (sized as FBGEMM sizes them).

``update(rows, grads, state_rows, count)`` is a pure function over gathered
rows ``[U, D]``, their summed gradients ``[U, D]`` (float32) and the state
slices of those rows; ``count`` is the step number after this update (1 on
the first step). The same function serves the XLA scatter path, Pallas kernels
and sharded tables. Pallas kernels pad ``D`` to a power of two with zero
columns and pass the keyword ``dim=D``: row-wise means divide by it (padded
columns must not change any real column; their outputs are discarded).
Column-sharded tables see a slice of each row: they pass ``dim`` (the full
widths, ``[U]``) and ``row_sum``, a function completing per-row partial sums
``[U]`` across the row's shards, so row-wise state and norms equal unsharded.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import optax

ScalarOrSchedule = float | optax.Schedule

# A sparse optimizer's state: a NamedTuple whose first field is an int32 ``count`` and
# whose others are per-row arrays (see the module docstring). Each optimizer has its own
# NamedTuple (``AdagradState``...), and no Protocol can name "any NamedTuple with
# ``count``" (``count`` clashes with ``tuple.count``), so this stays Any, as optax's
# ``OptState`` is an arbitrary pytree.
SparseOptState: TypeAlias = Any


class WeightDecayMode(enum.Enum):
    """FBGEMM's weight decay modes. NONE ignores ``weight_decay``."""

    NONE = "NONE"
    L2 = "L2"  # added to the gradient before the update (and to accumulators)
    DECOUPLE = "DECOUPLE"  # w -= lr * weight_decay * w, beside the update


class EmbOptimType(enum.Enum):
    """FBGEMM's (and TorchRec's) optimizer types that jaxrec implements.

    A native kernel picks its update by this kind (``jaxrec.cpu`` runs the
    three EXACT ones); the value is the name printed in parameter groups.
    """

    EXACT_SGD = "EXACT_SGD"
    EXACT_ADAGRAD = "EXACT_ADAGRAD"
    EXACT_ROWWISE_ADAGRAD = "EXACT_ROWWISE_ADAGRAD"
    ADAM = "ADAM"
    PARTIAL_ROWWISE_ADAM = "PARTIAL_ROWWISE_ADAM"
    LAMB = "LAMB"
    PARTIAL_ROWWISE_LAMB = "PARTIAL_ROWWISE_LAMB"
    LARS_SGD = "LARS_SGD"


class NoParams(NamedTuple):
    """No hyper-parameters besides the learning rate (an optimizer of your own)."""


class SparseOptimizer(NamedTuple):
    """A row-wise optimizer: ``init(num_rows, dim)`` and ``update(...)``.

    Attributes:
        init: ``(num_rows, dim) -> state`` (``count`` 0, per-row arrays).
        update: ``(rows [U, D], grads [U, D] f32, state_rows, count, *, dim=None,
            row_sum=None) -> (new_rows [U, D] f32, new_state_rows)``; ``dim`` is
            the logical width when rows arrive zero-padded or column-split and
            ``row_sum`` completes per-row sums across column shards (both
            optional for custom optimizers that reduce nothing over a row).
        kind: FBGEMM's optimizer type; ``None`` for an optimizer of your own
            (no native kernel runs it).
        learning_rate: the learning rate or schedule.
        params: the other hyper-parameters, a typed ``NamedTuple`` (e.g.
            ``AdagradParams``; ``NoParams()`` by default). Native kernels read
            them; ``update`` closes over them.
    """

    init: Callable[[int, int], SparseOptState]
    update: Callable[..., tuple[jax.Array, SparseOptState]]
    kind: EmbOptimType | None
    learning_rate: ScalarOrSchedule
    params: NamedTuple = NoParams()

    @property
    def name(self) -> str:
        """FBGEMM's name of the optimizer (``"CUSTOM"`` without a kind), for printing."""
        return "CUSTOM" if self.kind is None else self.kind.value

    @property
    def hyperparams(self) -> dict[str, Any]:
        """``params`` as a dict for printing (enum members as their values)."""
        return {
            field: value.value if isinstance(value, enum.Enum) else value
            for field, value in zip(self.params._fields, self.params, strict=True)
        }

    # Hashed and compared by identity, so an optimizer can be a static argument
    # of ``jax.jit`` and two optimizers built alike stay distinct (each closes
    # over its own ``update``).
    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other


def lr_at(learning_rate: ScalarOrSchedule, count: jax.Array) -> jax.Array:
    """The learning rate for step ``count`` (1-based); optax schedules see ``count - 1``."""
    if callable(learning_rate):
        return jnp.asarray(learning_rate(count - 1), jnp.float32)
    return jnp.asarray(learning_rate, jnp.float32)


def row_fields(state: SparseOptState) -> tuple[str, ...]:
    """Names of the per-row fields of a state (every field but ``count``)."""
    return tuple(f for f in state._fields if f != "count")


def gather_state(state: SparseOptState, rows: jax.Array) -> SparseOptState:
    """State slices of ``rows`` (out-of-range rows read zeros)."""
    return state._replace(
        **{f: getattr(state, f).at[rows].get(mode="fill", fill_value=0) for f in row_fields(state)}
    )


def scatter_state(
    state: SparseOptState, rows: jax.Array, new_rows: SparseOptState
) -> SparseOptState:
    """Writes row slices back; out-of-range rows (fill ids) are dropped."""
    return state._replace(
        **{
            f: getattr(state, f).at[rows].set(getattr(new_rows, f), mode="drop")
            for f in row_fields(state)
        }
    )


def apply_rows(
    optimizer: SparseOptimizer,
    table: jax.Array,
    state: SparseOptState,
    rows: jax.Array,
    grads: jax.Array,
    state_rows: jax.Array | None = None,
    **update_kwargs: Any,
) -> tuple[jax.Array, SparseOptState]:
    """Applies one optimizer step to the touched ``rows`` of ``table``: the XLA row update
    (gather, ``optimizer.update``, scatter) every kernel is checked against.

    Args:
        optimizer: the sparse optimizer.
        table: ``[R, D]`` weights (any float dtype; updated in float32, cast back).
        state: the optimizer state for ``table`` (per-row fields ``[R, ...]``).
        rows: ``[U]`` unique row ids; ids ``>= R`` (fill) are skipped.
        grads: ``[U, D]`` summed gradients of those rows.
        state_rows: ``[U]`` the rows' state rows, when the state covers a subset
            of the table's rows (default: ``rows``); fill entries are skipped.
        update_kwargs: to ``optimizer.update`` (``dim=``, ``row_sum=`` for column shards).

    Returns:
        The updated ``(table, state)``. Untouched rows are unchanged; under
        ``jit`` with donated inputs, XLA updates both in place.
    """
    state_rows = rows if state_rows is None else state_rows
    count = state.count + 1
    w = table.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)
    new_w, new_state_rows = optimizer.update(
        w, grads.astype(jnp.float32), gather_state(state, state_rows), count, **update_kwargs
    )
    table = table.at[rows].set(new_w.astype(table.dtype), mode="drop")
    state = scatter_state(state, state_rows, new_state_rows)._replace(count=count)
    return table, state
