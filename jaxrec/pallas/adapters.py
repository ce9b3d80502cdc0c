"""Adapters from ``jaxrec.ops`` entry points to the Pallas kernels.

Each takes the arguments of the op's XLA function (``jaxrec.xla``) plus
``interpret``; ``jaxrec.ops.backends`` lists which adapter serves which op.
The dispatcher passes ``interpret=False`` in the branch it stages for GPUs
(compiled through Triton) and True for other platforms, where a forced
``"pallas"`` runs in the Pallas interpreter (slow: for tests). Forward kernels
differentiate as the XLA path (``jaxrec.xla.vjp.with_xla_vjp``), so
``jax.grad`` through a lookup works whichever forward ran.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..xla.lookup import embedding_bag_xla, embedding_gather_xla
from ..xla.vjp import with_xla_vjp
from .pooled import pooled_lookup, ranges_from_segments
from .sequence import sequence_lookup
from .update import fused_backward_update, sparse_update


def _bag_kernel(weights, rows, segment_ids, num_segments, scale, interpret):
    starts, ends = ranges_from_segments(segment_ids, num_segments)
    scale = jnp.where(segment_ids < num_segments, scale.astype(jnp.float32), 0.0)
    return pooled_lookup(weights, rows, starts, ends, scale, segment_ids, interpret=interpret)


def _bag_xla(weights, rows, segment_ids, num_segments, scale, interpret):
    del interpret
    return embedding_bag_xla(weights, rows, segment_ids, num_segments, scale)


_bag = with_xla_vjp(_bag_kernel, _bag_xla, nondiff_argnums=(3, 5))


def embedding_bag_pallas(
    weights, rows, segment_ids, num_segments, per_value_scale=None, *, interpret
):
    """``jaxrec.ops.embedding_bag`` on :func:`pooled_lookup` (segments -> ranges first)."""
    scale = jnp.ones(rows.shape, jnp.float32) if per_value_scale is None else per_value_scale
    return _bag(weights, rows, segment_ids.astype(jnp.int32), num_segments, scale, interpret)


def _gather_kernel(weights, rows, valid, interpret):
    return sequence_lookup(weights, rows, valid, interpret=interpret)


def _gather_xla(weights, rows, valid, interpret):
    del interpret
    return embedding_gather_xla(weights, rows, valid)


_gather = with_xla_vjp(_gather_kernel, _gather_xla, nondiff_argnums=(3,))


def embedding_gather_pallas(weights, rows, valid, *, interpret):
    """``jaxrec.ops.embedding_gather`` on :func:`sequence_lookup`."""
    return _gather(weights, rows, valid, interpret)


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
