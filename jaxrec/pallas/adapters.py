"""Adapters from ``jaxrec.ops`` entry points to the Pallas kernels.

Each takes the arguments of the op's XLA function (``jaxrec.xla``) plus
``interpret``; ``jaxrec.ops.backends`` lists which adapter serves which op.
The dispatcher passes ``interpret=False`` in the branch it stages for GPUs
(compiled through Triton) and True for other platforms, where a forced
``"pallas"`` runs in the Pallas interpreter (slow: for tests). Forward kernels
get a ``custom_vjp`` whose backward is the XLA path's autodiff (the gradient
oracle), so ``jax.grad`` through a lookup works whichever forward ran.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..xla.lookup import embedding_bag_xla, embedding_gather_xla
from .pooled import pooled_lookup, ranges_from_segments
from .sequence import sequence_lookup
from .update import fused_backward_update, sparse_update


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 5))
def _bag(weights, rows, segment_ids, num_segments, scale, interpret):
    starts, ends = ranges_from_segments(segment_ids, num_segments)
    scale = jnp.where(segment_ids < num_segments, scale.astype(jnp.float32), 0.0)
    return pooled_lookup(weights, rows, starts, ends, scale, segment_ids, interpret=interpret)


def _bag_fwd(weights, rows, segment_ids, num_segments, scale, interpret):
    return _bag(weights, rows, segment_ids, num_segments, scale, interpret), (
        weights,
        rows,
        segment_ids,
        scale,
    )


def _bag_bwd(num_segments, interpret, res, g):
    weights, rows, segment_ids, scale = res
    _, vjp = jax.vjp(
        lambda w, s: embedding_bag_xla(w, rows, segment_ids, num_segments, s), weights, scale
    )
    dw, ds = vjp(g)
    return dw, None, None, ds


_bag.defvjp(_bag_fwd, _bag_bwd)


def embedding_bag_pallas(
    weights, rows, segment_ids, num_segments, per_value_scale=None, *, interpret
):
    """``jaxrec.ops.embedding_bag`` on :func:`pooled_lookup` (segments -> ranges first)."""
    scale = jnp.ones(rows.shape, jnp.float32) if per_value_scale is None else per_value_scale
    return _bag(weights, rows, segment_ids.astype(jnp.int32), num_segments, scale, interpret)


def embedding_gather_pallas(weights, rows, valid, *, interpret):
    """``jaxrec.ops.embedding_gather`` on :func:`sequence_lookup`."""
    return _gather(weights, rows, valid, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather(weights, rows, valid, interpret):
    return sequence_lookup(weights, rows, valid, interpret=interpret)


def _gather_fwd(weights, rows, valid, interpret):
    return _gather(weights, rows, valid, interpret), (weights, rows, valid)


def _gather_bwd(interpret, res, g):
    weights, rows, valid = res
    _, vjp = jax.vjp(lambda w: embedding_gather_xla(w, rows, valid), weights)
    return (*vjp(g), None, None)


_gather.defvjp(_gather_fwd, _gather_bwd)


def sparse_update_pallas(optimizer, table, state, rows, grads, state_rows=None, *, interpret):
    """``jaxrec.embedding.sparse_update.update_subgroup``'s row update on :func:`sparse_update`."""
    return sparse_update(optimizer, table, state, rows, grads, state_rows, interpret=interpret)


def fused_backward_update_pallas(
    optimizer, table, state, out_grad, seg, scale, rows, valid, *, interpret
):
    """``jaxrec.embedding.sparse_update.backward_update`` on :func:`fused_backward_update`."""
    return fused_backward_update(
        optimizer, table, state, out_grad, seg, scale, rows, valid, interpret=interpret
    )
