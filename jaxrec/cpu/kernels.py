"""JAX wrappers of the C++ CPU kernels: ``jax.ffi.ffi_call`` behind the ``jaxrec.ops`` signatures.

Each wrapper raises ``NotImplementedError`` for arguments its kernel does not
take (the dispatcher then runs XLA). ``ffi_call`` has no autodiff: the pooled
lookups differentiate as the XLA path (``jaxrec.xla.vjp.with_xla_vjp``, the
gradient oracle); the fused update is only called by the sparse train step's explicit
backward. Handlers take fixed-rank buffers, so ``vmap`` runs them sequentially.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..configs import PoolingType
from ..optim import AdagradParams, EmbOptimType, SgdParams, WeightDecayMode
from ..optim.base import lr_at, row_fields
from ..sparse import KeyedJaggedTensor
from ..xla.bounds import BoundsCheckMode, report_out_of_range
from ..xla.layout import report_bad_bags, report_bad_weights
from ..xla.lookup import embedding_bag_xla
from ..xla.vjp import with_xla_vjp
from .loader import load

_TABLE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Optimizer kind -> (FFI target, per-row state rank: None, 1 for [R], 2 for [R, D]).
_UPDATES = {
    EmbOptimType.EXACT_SGD: ("jaxrec_backward_update_sgd", None),
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: ("jaxrec_backward_update_rowwise_adagrad", 1),
    EmbOptimType.EXACT_ADAGRAD: ("jaxrec_backward_update_adagrad", 2),
}
_MODES = {WeightDecayMode.NONE: 0, WeightDecayMode.L2: 1, WeightDecayMode.DECOUPLE: 2}


def _fits_int32(dtype) -> bool:
    """Ids the kernels may read as int32: a lossless cast, so they check each id's own value.

    Wider ids (uint32, int64, uint64) go to the XLA path, which bounds-checks them
    in their own width before any narrowing (``jaxrec.xla.bounds.ids_in_range``).
    """
    info = jnp.iinfo(dtype)
    return info.min >= np.iinfo(np.int32).min and info.max <= np.iinfo(np.int32).max


def _kernel_lengths(features) -> jax.Array:
    """int32 lengths, as they are: the kernels apply ``jaxrec.sparse.bags``' rule
    themselves while walking them (invalid bags read nothing). Wider lengths
    saturate, so a bad length stays bad (negative, or past any capacity)."""
    lengths = features.lengths()
    if lengths.dtype == jnp.int32:
        return lengths
    info = jnp.iinfo(lengths.dtype)
    if info.max > np.iinfo(np.int32).max:
        lengths = jnp.minimum(lengths, np.array(np.iinfo(np.int32).max, lengths.dtype))
    if info.min < -1:
        lengths = jnp.maximum(lengths, np.array(-1, lengths.dtype))
    return lengths.astype(jnp.int32)


def _kernel_weights(weights) -> jax.Array:
    """float32 per-sample weights (the kernels count NaN / inf as zero); ``[0]`` for none."""
    if weights is None:
        return jnp.zeros((0,), jnp.float32)
    return weights.astype(jnp.float32)


def _require_kernels() -> None:
    reason = load()
    if reason is not None:
        raise NotImplementedError(f"jaxrec's C++ CPU kernels are unavailable: {reason}")


def _check_table(weights: jax.Array, name: str) -> None:
    if weights.ndim != 2 or jnp.dtype(weights.dtype) not in _TABLE_DTYPES:
        raise NotImplementedError(
            f"the CPU kernels take [R, D] float32 or bfloat16 {name}, got "
            f"{name}.shape={weights.shape} {name}.dtype={weights.dtype}"
        )


# ----- pooled lookup -----
def _bag_call(weights, rows, segment_ids, num_segments, scale):
    out = jax.ShapeDtypeStruct((num_segments, weights.shape[1]), jnp.float32)
    call = jax.ffi.ffi_call("jaxrec_embedding_bag", out, vmap_method="sequential")
    return call(weights, rows, segment_ids, scale)


_bag = with_xla_vjp(_bag_call, embedding_bag_xla, nondiff_argnums=(3,))


def embedding_bag_cpu(weights, rows, segment_ids, num_segments, per_value_scale=None):
    """``jaxrec.ops.embedding_bag`` on the C++ kernel: ``[S, D]`` float32 sums.

    Rows outside ``[0, R)`` are clamped (as the XLA path's ``mode="clip"``);
    segment ids outside ``[0, S)`` contribute nothing. Each product
    ``w[row] * scale`` is rounded and summed in id order, as XLA does.
    """
    _require_kernels()
    _check_table(weights, "weights")
    scale = (
        jnp.ones(rows.shape, jnp.float32)
        if per_value_scale is None
        else per_value_scale.astype(jnp.float32)
    )
    return _bag(
        weights, rows.astype(jnp.int32), segment_ids.astype(jnp.int32), int(num_segments), scale
    )


# ----- table-batched pooled lookup straight from the KeyedJaggedTensor -----
def _kjt_call(weights, features, static):
    slots, drop = static
    b = features.stride()
    values = features.values()
    pvw = _kernel_weights(features.weights_or_none())
    info = np.asarray([s[:4] for s in slots], np.int32).reshape(len(slots), 4)
    starts = np.asarray(features.capacity_offsets(), np.int32)
    shapes = (
        jax.ShapeDtypeStruct((b, len(slots), weights.shape[1]), jnp.float32),
        jax.ShapeDtypeStruct((6,), jnp.int32),
    )
    call = jax.ffi.ffi_call("jaxrec_kjt_embedding_bag", shapes, vmap_method="sequential")
    return call(
        weights,
        values.astype(jnp.int32),
        _kernel_lengths(features),
        pvw,
        jnp.asarray(info),
        jnp.asarray(starts),
        drop=np.int32(drop),
    )


def _kjt_xla(weights, features, static, xla_fn):
    del static
    return xla_fn(weights, features)


# The kernel also returns what it found wrong (bad ids, bags, weights): no gradient.
_kjt_bag = with_xla_vjp(
    lambda weights, features, static, xla_fn: _kjt_call(weights, features, static),
    _kjt_xla,
    nondiff_argnums=(2, 3),
    has_aux=True,
)


def grouped_pooled_lookup_cpu(
    weights, features, slots, *, is_weighted, bounds_check_mode, where, xla_fn
):
    """``jaxrec.ops.grouped_pooled_lookup`` in one C++ call: ``[B, S, D]`` float32.

    The kernel reads the KJT's values and lengths directly (no segment ids,
    masks or row arrays are formed), empties invalid bags (``jaxrec.sparse.bags``),
    drops out-of-range ids (or clamps them under ``BoundsCheckMode.NONE``, as
    XLA does), applies per-sample weights (non-finite ones as zero) and MEAN,
    and counts the invalid bags, non-finite weights and out-of-range ids with
    the first of each, which feed the same WARNING / FATAL reporting as the XLA
    path (``jaxrec.ops.layout``, ``jaxrec.xla.bounds``). ``xla_fn(weights,
    features)`` is the XLA lookup, whose autodiff is the backward.
    """
    _require_kernels()
    _check_table(weights, "weights")
    keys = features.keys()
    values = features.values()
    if any(sl.key not in keys for sl in slots) or not _fits_int32(values.dtype):
        raise NotImplementedError("missing keys or ids wider than int32: the XLA path checks them")
    mode = BoundsCheckMode(bounds_check_mode)
    static = (
        tuple(
            (
                keys.index(sl.key),
                sl.row_offset,
                sl.num_embeddings,
                int(PoolingType(sl.pooling) is PoolingType.MEAN),
            )
            for sl in slots
        ),
        int(mode is not BoundsCheckMode.NONE),
    )
    if not is_weighted and features.weights_or_none() is not None:
        features = KeyedJaggedTensor.from_parts(
            keys,
            values,
            features.lengths(),
            capacities=features.capacity_per_key(),
            stride=features.stride(),
        )
    out, bad = _kjt_bag(weights, features, static, xla_fn)
    # In the XLA path's order (``jaxrec.ops.grouped``): bags, weights, ids.
    report_bad_bags(bad[2], bad[3], mode, where, [sl.key for sl in slots])
    if is_weighted:
        report_bad_weights(bad[4], bad[5], mode, where, keys, features.capacity_offsets())
    report_out_of_range(bad[0], bad[1], mode, where)
    return out


# ----- fused backward + optimizer update -----
def _update_attrs(optimizer) -> dict:
    """The C++ update's scalar attributes, from the optimizer's typed hyper-parameters."""
    match optimizer.params:
        case SgdParams(weight_decay=weight_decay, weight_decay_mode=mode):
            eps = 0.0
        case AdagradParams(eps=eps, weight_decay=weight_decay, weight_decay_mode=mode):
            pass
        case params:
            raise NotImplementedError(
                f"the CPU kernels take SgdParams or AdagradParams, got {params!r} "
                f"for {optimizer.name}"
            )
    return {
        "eps": np.float32(eps),
        "weight_decay": np.float32(weight_decay),
        "mode": np.int32(_MODES[WeightDecayMode(mode)]),
    }


def _fused_update(optimizer, table, state, target_of, operands):
    """Calls the fused update FFI target ``target_of(name)`` in place on ``table`` and ``state``.

    ``operands(lr)`` are the arguments after the aliased table and state buffers.
    """
    _require_kernels()
    if optimizer.kind not in _UPDATES:
        raise NotImplementedError(f"no CPU kernel for the {optimizer.name} optimizer")
    _check_table(table, "table")
    target, state_rank = _UPDATES[optimizer.kind]
    fields = row_fields(state)
    r, d = table.shape
    want = () if state_rank is None else ((r,) if state_rank == 1 else (r, d))
    if len(fields) != (0 if state_rank is None else 1) or any(
        getattr(state, f).shape != want or getattr(state, f).dtype != jnp.float32 for f in fields
    ):
        raise NotImplementedError(f"unexpected {optimizer.name} state layout")
    attrs = _update_attrs(optimizer)
    count = state.count + 1
    lr = lr_at(optimizer.learning_rate, count).reshape(()).astype(jnp.float32)
    states = tuple(getattr(state, f) for f in fields)
    shapes = (jax.ShapeDtypeStruct(table.shape, table.dtype),) + tuple(
        jax.ShapeDtypeStruct(s.shape, s.dtype) for s in states
    )
    call = jax.ffi.ffi_call(
        target_of(target),
        shapes,
        input_output_aliases={i: i for i in range(len(shapes))},
        vmap_method="sequential",
    )
    new_table, *new_states = call(
        table,
        *states,
        *operands(lr),
        **attrs,
    )
    return new_table, state._replace(count=count, **dict(zip(fields, new_states, strict=True)))


def backward_update_cpu(optimizer, table, state, out_grad, seg, scale, rows, valid):
    """``jaxrec.train.backward_update`` on the C++ kernel, in place on ``table`` and ``state``.

    Supports EXACT_SGD, EXACT_ROWWISE_ADAGRAD and EXACT_ADAGRAD (every weight
    decay mode) on float32 / bfloat16 tables with float32 state; the update
    maths are ``jaxrec.optim``'s. Under ``jit`` with ``table`` and ``state``
    donated, the call writes into their buffers (no copy).
    """
    d = table.shape[-1]
    keyed = jnp.where(valid, rows, table.shape[0]).astype(jnp.int32)  # fill R: skipped
    return _fused_update(
        optimizer,
        table,
        state,
        lambda target: target,
        lambda lr: (
            out_grad.astype(jnp.float32).reshape(-1, d),
            seg.astype(jnp.int32),
            scale.astype(jnp.float32),
            keyed,
            lr,
        ),
    )


def kjt_backward_update_cpu(
    optimizer, table, state, grad, features, slots, columns, *, is_weighted, dep
):
    """A pooled lookup's backward fused with one optimizer step, read from the KJT directly.

    The same update as :func:`backward_update_cpu` over
    ``jaxrec.xla.backward.pooled_grad_sources(features, slots)``, without
    forming any per-id array in XLA: the kernel walks the KJT's values and
    lengths and reads bag ``b`` of slot ``s``'s gradient in place from
    ``grad[b, columns[s] : columns[s] + D]``.

    Args:
        grad: ``[B, W]`` gradient of the collection's pooled output.
        slots: the group's ``S`` feature slots; ``columns``: ``S`` static
            column offsets into ``grad``.
        dep: a scalar the update must wait for (the loss), so that XLA runs
            the forward's reads of ``table`` before this in-place write.
    """
    keys = features.keys()
    values = features.values()
    if any(sl.key not in keys for sl in slots) or not _fits_int32(values.dtype):
        raise NotImplementedError("missing keys or ids wider than int32: the XLA path checks them")
    if grad.ndim != 2 or grad.shape[0] != features.stride():
        raise NotImplementedError(f"grad must be [B, W], got {grad.shape=}")
    pvw = _kernel_weights(features.weights_or_none() if is_weighted else None)
    info = np.asarray(
        [
            (
                keys.index(sl.key),
                sl.row_offset,
                sl.num_embeddings,
                int(PoolingType(sl.pooling) is PoolingType.MEAN),
                col,
            )
            for sl, col in zip(slots, columns, strict=True)
        ],
        np.int32,
    ).reshape(len(slots), 5)
    starts = np.asarray(features.capacity_offsets(), np.int32)
    return _fused_update(
        optimizer,
        table,
        state,
        lambda target: target.replace("jaxrec_", "jaxrec_kjt_", 1),
        lambda lr: (
            grad.astype(jnp.float32),
            values.astype(jnp.int32),
            _kernel_lengths(features),
            pvw,
            jnp.asarray(info),
            jnp.asarray(starts),
            lr,
            jnp.asarray(dep, jnp.float32).reshape(()),
        ),
    )
