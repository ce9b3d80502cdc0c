"""d loss / d per-id weights of a sharded pooled lookup (trainable feature processors).

A weighted bag pools ``sum_i w_i * E[id_i]`` (times ``1 / length`` for MEAN),
so ``d loss / d w_i = <g[bag_i], E[id_i]>`` with ``g`` the output gradient of
the bag's columns. The sharded forward cannot be differentiated by JAX (the
weights travel bit-cast in the int32 id payload, extra exchange rounds are
while loops), so :func:`weight_gradient_term` adds a zero to the output whose
custom backward computes this: a sequence exchange of the ids (one round,
sized to the natural payload, so nothing overflows) brings each id's row home,
column shards placed as a sharded ``EmbeddingCollection`` places them, and
each device dots them with its own output gradient. Replicated tables are
read locally.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..configs import PoolingType
from ..sparse import KeyedJaggedTensor
from . import embedding_dist as dist
from . import exchange
from .capacity import natural_load


def weight_gradient_term(coll, tables: dict, features: KeyedJaggedTensor, weights: jax.Array):
    """Zeros ``[world * B, sum(D)]`` whose gradient with respect to ``weights`` (the
    stacked KJT's ``[world, C]`` weights) is that of ``coll``'s pooled output.

    Add it to the output of ``coll(features)`` (a ``ShardedEmbeddingBagCollection``
    given ``features`` with the same, gradient-stopped, weights).
    """
    shape = (features.values().shape[0] * features.stride(), sum(coll.layout.dims))

    @jax.custom_vjp
    def term(w, tables, kjt):
        del w, tables, kjt
        return jnp.zeros(shape, jnp.float32)

    def fwd(w, tables, kjt):
        return term(w, tables, kjt), (tables, kjt)

    def bwd(res, g):
        tables, kjt = res
        dw = _weight_grads(coll, tables, kjt, g)
        return (dw, *jax.tree.map(_zero_cotangent, (tables, kjt)))

    term.defvjp(fwd, bwd)
    return term(weights, tables, features)


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def _weight_grads(coll, tables, features, g):
    """``[world, C]`` float32: d loss / d each id's weight, from the output gradient ``g``."""
    return jax.shard_map(
        lambda t, f, gl: _local(coll, t, dist.local_kjt(f), gl)[None],
        mesh=coll.mesh,
        in_specs=(coll._specs(), P(coll.axis), P(coll.axis)),
        out_specs=P(coll.axis),
        check_vma=False,
    )(tables, features, g.astype(jnp.float32))


def _local(coll, tables, kjt, g_local):
    keys, offs, b = kjt.keys(), kjt.capacity_offsets(), kjt.stride()
    caps = dict(zip(keys, kjt.capacity_per_key(), strict=True))
    seg = kjt.segment_ids()
    dw = [jnp.zeros((offs[k + 1] - offs[k],), jnp.float32) for k in range(len(keys))]

    def bags(k):  # [cap_k] the bag of each id of key k (padding: clipped, its row is zero)
        return jnp.clip(seg[offs[k] : offs[k + 1]] - k * b, 0, b - 1)

    for grp in coll.layout.groups:
        spec = exchange.Spec(
            n=coll.layout.world_size,
            capacity=natural_load(caps, grp.slots),
            slots=grp.max_slots,
            bags=0,
            fill=grp.rows_per_rank,
            weighted=False,
            sequence=True,
        )
        box = exchange.outbox(kjt, grp, spec)
        got = exchange.send(box, spec, 0, coll.axis, first=True)
        rec, _ = exchange.receive(got, spec, 0, None, first=True)
        gather = lambda *a, grp=grp: coll._gather_rows(grp, *a)
        rows = dist.sequence_rows(gather, tables[grp.name], rec)
        back = dist.send_back(rows, coll.axis, jnp.float32)

        def add(sl, r):  # r [cap_k, sl.ncols]: each id's row slice (zero if not in this shard)
            k = keys.index(sl.key)
            grad = coll._read_block(g_local, kjt, sl, sl.ncols, b)  # MEAN: already / length
            dw[k] = dw[k] + jnp.sum(r * grad[bags(k)], axis=1)

        dist.place_rows(back, box, grp, 0, spec.capacity, add)
    cols = dist.column_offsets(coll.layout)
    for rg in coll.replicated_groups:
        table = tables[coll.dp_buffer(rg)]
        for sl, o in zip(rg.slots, coll._dp_outputs(rg), strict=True):
            k = keys.index(sl.key)
            ids = kjt.values()[offs[k] : offs[k + 1]]
            ok = (seg[offs[k] : offs[k + 1]] < len(keys) * b) & (ids >= 0)
            ok = ok & (ids < sl.num_embeddings)
            rows = jnp.take(table, jnp.where(ok, ids + sl.row_offset, 0), axis=0)
            grad = g_local[:, cols[o] : cols[o + 1]] * _mean_factor(kjt, k, sl)
            dots = jnp.sum(rows.astype(jnp.float32) * grad[bags(k)], axis=1)
            dw[k] = dw[k] + jnp.where(ok, dots, 0.0)
    return jnp.concatenate(dw)


def _mean_factor(kjt, k: int, slot):
    """``[B, 1]`` ``1 / max(length, 1)`` of a MEAN slot of key ``k``, else 1.0."""
    if slot.pooling is not PoolingType.MEAN:
        return 1.0
    b = kjt.stride()
    lengths = kjt.lengths()[k * b : (k + 1) * b]
    return (1.0 / jnp.maximum(lengths, 1).astype(jnp.float32))[:, None]
