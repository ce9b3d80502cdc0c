"""The stages of a sharded lookup after the id exchange, per device, and their backward.

Everything here runs inside ``jax.shard_map`` over the flattened mesh axes
(``axis``): each device holds a local batch of ``B`` samples and, per width
group, its stacked shards ``[rows_per_rank, ncols]``. The ids arrive through
``exchange.py`` (one or more rounds of ``[N_src, C]``).

Pooled (EmbeddingBagCollection):

- lookup: one segment-sum over a round's received ids into partial blocks
  ``[N_src, S, B, ncols]`` (slot ``j`` of this rank, bag ``b``, per source);
  rounds add up before anything is sent back;
- output_dist: one ``all_to_all`` of the blocks back to the devices owning the
  samples, which sum row shards, place column shards and divide MEAN bags by
  their length (so shards never need a bag's whole length);
- backward: the gradient blocks travel the reverse way once; each round's ids
  read their bag's gradient (times their weight).

Sequence (EmbeddingCollection): the shard gathers one row per received id,
``[N_src, C, ncols]`` in payload order, and sends it back; the source puts each
row at its id's position (it remembers every id's payload index). Backward,
the source sends each id's output gradient row in the same order.

Blocks and rows may travel in a lower precision (``qcomms``): cast before the
``all_to_all``, summed and applied in float32 (TorchRec's QComms).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from .exchange import Outbox, Received, Spec, round_targets
from .layout import ShardedLayout, WidthGroup

_Tree = TypeVar("_Tree")  # a pytree of stacked leaves


def local_kjt(kjt_stacked: _Tree) -> _Tree:
    """The device's own KJT from a stacked one (leaves ``[1, ...]`` inside shard_map);
    as well a stacked ``input_dist.Prefetched``."""
    leaves, treedef = jax.tree.flatten(kjt_stacked)
    return jax.tree.unflatten(treedef, [x[0] for x in leaves])


def column_offsets(layout: ShardedLayout) -> np.ndarray:
    return np.cumsum([0, *layout.dims])


def send_back(
    x: jax.Array, axis, dtype, scale: float | None = None, ragged: tuple | None = None
) -> jax.Array:
    """``all_to_all`` over the leading (device) axis in ``dtype``; float32 on arrival.

    ``scale`` multiplies the payload before the cast and divides it after (a loss
    scale, so that small fp16 gradients do not underflow). ``ragged``:
    ``(sent, received)`` ``[N]``: how many leading rows of each block this device
    sends to, and receives from, each device, moved by ``ragged_all_to_all``
    (GPUs); the rest of every block stays zero and is not sent.
    """
    if scale is not None:
        x = x * scale
    x = x.astype(dtype)
    if ragged is None:
        got = jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
    else:
        got = _ragged_blocks(x, axis, *ragged)
    got = got.astype(jnp.float32)
    return got if scale is None else got / scale


def _ragged_blocks(x: jax.Array, axis, sent: jax.Array, received: jax.Array) -> jax.Array:
    """``x [N, M, ...]``: block ``p`` goes to device ``p``; only its first ``sent[p]``
    rows of ``M`` travel (``received[q]`` from device ``q``)."""
    n, m = x.shape[0], x.shape[1]
    inner = int(np.prod(x.shape[2:], dtype=np.int64))
    me = jax.lax.axis_index(axis).astype(jnp.int32)
    got = jax.lax.ragged_all_to_all(
        x.reshape(n * m * inner),
        jnp.zeros((n * m * inner,), x.dtype),
        jnp.arange(n, dtype=jnp.int32) * (m * inner),
        jnp.asarray(sent, jnp.int32) * inner,
        jnp.full((n,), me * (m * inner), jnp.int32),
        jnp.asarray(received, jnp.int32) * inner,
        axis_name=axis,
    )
    return got.reshape(x.shape)


def slot_counts(group: WidthGroup, axis) -> tuple[jax.Array, jax.Array]:
    """``(blocks each rank sends back, blocks it receives from each rank)`` of a group's
    output_dist: a shard's own slots to every source, each shard's slots from it."""
    per = np.asarray([len(s) for s in group.slots], np.int32)
    me = jax.lax.axis_index(axis)
    return jnp.broadcast_to(jnp.asarray(per)[me], per.shape), jnp.asarray(per)


# ----- pooled -----
def pooled_partials(lookup: Callable, table, rec: Received, spec: Spec) -> jax.Array:
    """``[N_src, S, B, ncols]`` partial sums of one round's ids (VBE: ``[N_src, sum_j B_j,
    ncols]``, slot ``j``'s ``B_j`` bags one after another).

    ``lookup(table, rows [K], segments [K], num_segments, scale [K] | None)``
    is the table-batched pooled lookup (``jaxrec.ops.embedding_bag`` or the
    quantized one); ids that are not there (fill) go to a dropped segment.
    """
    n, sb = spec.n, spec.sb
    assert rec.seg is not None  # a pooled exchange's ids carry their bags
    src = jnp.arange(n, dtype=jnp.int32)[:, None]
    seg = jnp.where(rec.valid & (rec.seg < sb), src * sb + rec.seg, n * sb)
    rows = jnp.where(rec.valid, rec.rows, 0)
    scale = None if rec.weights is None else rec.weights.reshape(-1)
    out = lookup(table, rows.reshape(-1), seg.reshape(-1), n * sb, scale)
    if spec.vbe_bags is not None:
        return out.reshape(n, sb, -1)
    return out.reshape(n, spec.slots, spec.bags, -1)


def _padded(block: jax.Array, ncols: int) -> jax.Array:
    """``block [.., w]`` with zero columns up to ``ncols`` (a zero-padded shard's gradient)."""
    extra = ncols - block.shape[-1]
    return block if not extra else jnp.pad(block, [(0, 0)] * (block.ndim - 1) + [(0, extra)])


def grads_to_ranks(
    blocks: jax.Array, group: WidthGroup, axis, dtype, scale=None, ragged: bool = False
) -> jax.Array:
    """Backward of output_dist: each rank receives ``[N_src, S, B, ncols]`` grads of its
    slots, where ``blocks[p, j]`` is this device's output gradient of rank ``p``'s slot
    ``j`` (zero-padded to the group's columns; zero for padding slots)."""
    sizes = slot_counts(group, axis)[::-1] if ragged else None  # each shard's own slots
    return send_back(blocks, axis, dtype, scale, sizes)


def pooled_row_grads(grad_blocks: jax.Array, rec: Received, spec: Spec):
    """Per-received-id row gradients: ``rows [K]``, ``grads [K, ncols]``, ``valid [K]``."""
    n, sb = spec.n, spec.sb
    assert rec.seg is not None  # a pooled exchange's ids carry their bags
    valid = rec.valid & (rec.seg < sb)
    src = jnp.arange(n, dtype=jnp.int32)[:, None]
    idx = jnp.where(valid, src * sb + rec.seg, 0).reshape(-1)
    flat = grad_blocks.reshape(n * sb, -1)
    g = jnp.take(flat, idx, axis=0)
    if rec.weights is not None:
        g = g * rec.weights.reshape(-1, 1)
    g = jnp.where(valid.reshape(-1, 1), g, 0.0)
    return rec.rows.reshape(-1), g, valid.reshape(-1)


# ----- sequence -----
def sequence_rows(gather: Callable, table, rec: Received) -> jax.Array:
    """``[N_src, C, ncols]`` float32 rows of one round's ids (zero where none)."""
    n, c = rec.rows.shape
    rows = jnp.where(rec.valid, rec.rows, 0).reshape(-1)
    out = gather(table, rows, rec.valid.reshape(-1))
    return out.astype(jnp.float32).reshape(n, c, -1)


def place_rows(received: jax.Array, box: Outbox, group: WidthGroup, r, capacity: int, add):
    """Hands round ``r``'s returned rows to ``add(slot, rows [cap_k, slot.ncols])``: each of
    the slot's id positions gets its row (zero where its id was not in this round)."""
    for p, slots in enumerate(group.slots):
        for j, sl in enumerate(slots):
            t = round_targets(box.slot_index[p][j], r, capacity)
            rows = jnp.take(received[p][:, : sl.ncols], jnp.minimum(t, capacity - 1), axis=0)
            add(sl, jnp.where((t < capacity)[:, None], rows, 0.0))


def sequence_grads(read, box: Outbox, group: WidthGroup, r, capacity: int, axis, dtype, scale):
    """Round ``r``'s per-id output gradients, sent to the shards: ``[N_src, C, ncols]``
    aligned with the ids the shard received; ``read(slot)`` is ``[cap_k, slot.ncols]``."""
    out = []
    for p, slots in enumerate(group.slots):
        buf = jnp.zeros((capacity, group.ncols), jnp.float32)
        for j, sl in enumerate(slots):
            t = round_targets(box.slot_index[p][j], r, capacity)
            buf = buf.at[t].set(_padded(read(sl), group.ncols), mode="drop")
        out.append(buf)
    return send_back(jnp.stack(out), axis, dtype, scale)
