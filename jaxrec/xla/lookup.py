"""The XLA lookups: the path every platform can run and every kernel is checked against."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def embedding_bag_xla(weights, rows, segment_ids, num_segments, per_value_scale=None):
    emb = jnp.take(weights, rows, axis=0, mode="clip").astype(jnp.float32)
    if per_value_scale is not None:
        emb = emb * per_value_scale.astype(jnp.float32)[:, None]
    return jax.ops.segment_sum(emb, segment_ids, num_segments=num_segments)


def embedding_gather_xla(weights, rows, valid):
    emb = jnp.take(weights, rows, axis=0, mode="clip")
    return jnp.where(valid[:, None], emb, jnp.zeros((), emb.dtype))
