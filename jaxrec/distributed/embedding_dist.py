"""The three stages of a sharded pooled lookup, and its backward, per device.

Everything here runs inside ``jax.shard_map`` over the flattened mesh axes
(``axis``): each device holds a local batch of ``B`` samples and, per width
group, its stacked shards ``[rows_per_rank, ncols]``.

- input_dist: for every destination rank and every slot it hosts, keep the
  ids that fall in the slot's row range, turn them into local rows, segment
  ``slot * B + bag`` and a scale (per-sample weight, 1/L for MEAN), compact
  them into a fixed capacity and ``all_to_all`` them.
- lookup: one segment-sum over the received ids (table-batched, local).
- output_dist: ``all_to_all`` the partial ``[slots, B, ncols]`` blocks back to
  the devices that own the samples, which sum row shards and place column
  shards into the output.

Table-wise and column-wise shards receive every id of their features (their
capacity equals the features' capacities, so nothing can overflow); row-wise
shards receive only their rows, within a capacity the user may lower.

A sequence (unpooled) lookup is the same engine with one "bag" per id
position: ``B`` becomes the largest feature capacity and a slot's partial
block holds one row per position of its feature.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..ops.pooled import embedding_bag
from ..sparse import KeyedJaggedTensor
from .layout import ShardedLayout, Slot, WidthGroup


def num_bags(kjt: KeyedJaggedTensor, sequence: bool) -> int:
    """Bags per slot block: the batch, or (sequence) the largest feature capacity."""
    return max(kjt.capacity_per_key()) if sequence else kjt.stride()


def _slot_entries(kjt: KeyedJaggedTensor, seg_all, slot: Slot, weighted: bool, sequence: bool):
    """Rows, bags, scales and mask of one slot's ids on this device."""
    keys = kjt.keys()
    k = keys.index(slot.key)
    lo, hi = kjt.capacity_offsets()[k], kjt.capacity_offsets()[k + 1]
    f, b = len(keys), kjt.stride()
    ids = kjt.values()[lo:hi]
    seg = seg_all[lo:hi]
    valid = (seg < f * b) & (ids >= slot.row0) & (ids < slot.row0 + slot.nrows)
    rows = jnp.where(valid, ids - slot.row0 + slot.local_offset, 0).astype(jnp.int32)
    scale = jnp.where(valid, 1.0, 0.0)
    if sequence:  # one bag per id position
        return rows, jnp.arange(hi - lo, dtype=jnp.int32), scale, valid
    bag = jnp.clip(seg - k * b, 0, b - 1)
    if weighted:
        scale = scale * kjt.weights()[lo:hi].astype(jnp.float32)
    if slot.mean:
        lengths = kjt.lengths()[k * b : (k + 1) * b]
        scale = scale / jnp.maximum(lengths, 1).astype(jnp.float32)[bag]
    return rows, bag, scale, valid


def natural_capacity(kjt: KeyedJaggedTensor, group: WidthGroup) -> int:
    """Per-destination capacity that can never overflow: the largest slot payload."""
    caps = dict(zip(kjt.keys(), kjt.capacity_per_key(), strict=True))
    return max(1, max(sum(caps[s.key] for s in slots) for slots in group.slots))


def input_dist(
    kjt: KeyedJaggedTensor,
    group: WidthGroup,
    axis,
    capacity: int,
    weighted: bool,
    sequence: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Sends every id to the rank holding its row; returns what this rank received.

    Returns:
        ``rows [N, cap]`` local rows, ``seg [N, cap]`` (``slot * B + bag``, or
        ``S * B`` for empty entries), ``scale [N, cap]`` float32, each indexed by
        source device, and this device's overflow count (ids that did not fit).
    """
    b, s = num_bags(kjt, sequence), group.max_slots
    seg_all = kjt.segment_ids()
    send_rows, send_seg, send_scale, overflow = [], [], [], jnp.zeros((), jnp.int32)
    for slots in group.slots:  # one destination rank at a time (static)
        parts = [_slot_entries(kjt, seg_all, sl, weighted, sequence) for sl in slots]
        if parts:
            rows = jnp.concatenate([p[0] for p in parts])
            seg = jnp.concatenate([j * b + p[1] for j, p in enumerate(parts)])
            scale = jnp.concatenate([p[2] for p in parts])
            valid = jnp.concatenate([p[3] for p in parts])
        else:
            rows = seg = jnp.zeros((1,), jnp.int32)
            scale, valid = jnp.zeros((1,), jnp.float32), jnp.zeros((1,), bool)
        pos = jnp.cumsum(valid) - 1
        dest = jnp.where(valid & (pos < capacity), pos, capacity)
        send_rows.append(jnp.zeros((capacity,), jnp.int32).at[dest].set(rows, mode="drop"))
        send_seg.append(jnp.full((capacity,), s * b, jnp.int32).at[dest].set(seg, mode="drop"))
        send_scale.append(jnp.zeros((capacity,), jnp.float32).at[dest].set(scale, mode="drop"))
        overflow += jnp.maximum(jnp.sum(valid, dtype=jnp.int32) - capacity, 0)
    recv = [
        jax.lax.all_to_all(jnp.stack(x), axis, 0, 0, tiled=True)
        for x in (send_rows, send_seg, send_scale)
    ]
    return (*recv, overflow)


def local_lookup(table: jax.Array, rows, seg, scale, s: int, b: int) -> jax.Array:
    """``[N_src, S, B, ncols]`` partial pooled blocks for every source device."""
    n = rows.shape[0]
    src = jnp.arange(n, dtype=jnp.int32)[:, None]
    seg_g = jnp.where(seg < s * b, src * (s * b) + seg, n * s * b)
    out = embedding_bag(table, rows.reshape(-1), seg_g.reshape(-1), n * s * b, scale.reshape(-1))
    return out.reshape(n, s, b, -1)


def output_dist(partials: jax.Array, axis) -> jax.Array:
    """Returns each source's blocks: ``[N_rank, S, B, ncols]`` from every rank."""
    return jax.lax.all_to_all(partials, axis, 0, 0, tiled=True)


def column_offsets(layout: ShardedLayout) -> np.ndarray:
    return np.cumsum([0, *layout.dims])


def assemble(received: jax.Array, group: WidthGroup, add) -> None:
    """Hands every rank's partial block of every slot to ``add(slot, block [B, ncols])``."""
    for p, slots in enumerate(group.slots):
        for j, sl in enumerate(slots):
            add(sl, received[p, j])


def grads_to_ranks(read, group: WidthGroup, b: int, axis) -> jax.Array:
    """Backward of output_dist: each rank receives ``[N_src, S, B, ncols]`` grads of its
    slots, where ``read(slot)`` is this device's ``[B, ncols]`` output gradient block."""
    blocks = []
    for slots in group.slots:
        per = [read(sl) for sl in slots]
        per += [jnp.zeros((b, group.ncols), jnp.float32)] * (group.max_slots - len(per))
        blocks.append(jnp.stack(per))
    return jax.lax.all_to_all(jnp.stack(blocks), axis, 0, 0, tiled=True)


def row_grads(recv_grads, rows, seg, scale, s: int, b: int):
    """Per-received-id row gradients ``[N*cap, ncols]`` (backward of local_lookup)."""
    n = rows.shape[0]
    valid = seg < s * b
    src = jnp.arange(n, dtype=jnp.int32)[:, None]
    idx = jnp.where(valid, src * (s * b) + seg, 0).reshape(-1)
    flat = recv_grads.astype(jnp.float32).reshape(n * s * b, -1)
    g = jnp.take(flat, idx, axis=0) * jnp.where(valid, scale, 0.0).reshape(-1, 1)
    return rows.reshape(-1), g, valid.reshape(-1)


def local_kjt(kjt_stacked: Any) -> KeyedJaggedTensor:
    """The device's own KJT from a stacked one (leaves ``[1, ...]`` inside shard_map)."""
    leaves, treedef = jax.tree.flatten(kjt_stacked)
    return jax.tree.unflatten(treedef, [x[0] for x in leaves])
