"""The id exchange of a sharded lookup: every id travels to the rank holding its row.

Everything here runs inside ``jax.shard_map`` (``axis``: the mesh's axes).
Per width group, a source lists, for each destination rank, the ids its slots
send there (slot by slot, in bag order) and numbers them ``0, 1, ...``: that
number is the id's payload index. A round carries ``capacity`` (``C``) ids per
destination in one fixed-size ``all_to_all``: round 0 the indices ``[0, C)``,
round ``r`` the indices ``[rC, (r+1)C)``. ``C`` is sized from the expected
load (``capacity.py``), so round 0 is the whole exchange on almost every
step; ids beyond it take further rounds, which every device runs together
(``rounds`` is a max over the mesh), so nothing is dropped.

A payload is one int32 array per destination: local rows (``fill``, out of
range, where no id is), then, for pooled lookups, where each id's bag is
(TorchRec's lengths), then the per-sample weights bit-cast, if any. The bag
information is whichever is smaller: per-(slot, bag) counts ``[S * B]`` (sent
in round 0; ids arrive in bag order, so counts locate them) or one segment
``slot * B + bag`` per id. Sequence lookups send rows only: the shard returns
one row per id in payload order and the source puts it back in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..sparse import KeyedJaggedTensor
from .layout import Slot, WidthGroup


@dataclasses.dataclass(frozen=True)
class Outbox:
    """A source's ids for one width group, per destination (lists of length ``N``).

    ``rows[p]``, ``bags[p]``, ``weights[p]`` and ``index[p]`` are ``[L_p]``
    (every candidate entry of destination ``p``'s slots, concatenated); an
    entry is sent iff ``index[p] >= 0`` (its payload index). ``slot_index[p][j]``
    is the part of ``index[p]`` that belongs to slot ``j`` (``[cap of its key]``).
    """

    rows: tuple[jax.Array, ...]
    bags: tuple[jax.Array, ...]  # slot * B + bag (pooled) or position in the key (sequence)
    weights: tuple[jax.Array, ...] | None
    index: tuple[jax.Array, ...]
    slot_index: tuple[tuple[jax.Array, ...], ...]
    counts: jax.Array  # [N] ids per destination
    bag_counts: jax.Array | None  # [N, S * B] ids per (slot, bag), pooled only


@dataclasses.dataclass(frozen=True)
class Spec:
    """Static shape of one group's exchange."""

    n: int  # devices
    capacity: int  # C: ids per destination per round
    slots: int  # S: most slots on one rank
    bags: int  # B (pooled: the batch; sequence: unused)
    fill: int  # the group's rows per rank: out-of-range local row
    weighted: bool
    sequence: bool

    @property
    def by_counts(self) -> bool:
        """Pooled payloads locate bags by counts when ``S * B <= C``, else by segments."""
        return not self.sequence and self.slots * self.bags <= self.capacity

    def width(self, first: bool) -> int:
        """int32 words per destination of round 0 (``first``) or a later round."""
        c = self.capacity
        meta = 0 if self.sequence else (self.slots * self.bags if self.by_counts else c)
        if self.by_counts and not first:
            meta = 0
        return c + meta + (c if self.weighted else 0)


def _slot_entries(kjt: KeyedJaggedTensor, seg_all, slot: Slot, spec: Spec):
    """Local rows, bag (or position), weights and mask of one slot's ids on this device."""
    keys = kjt.keys()
    k = keys.index(slot.key)
    lo, hi = kjt.capacity_offsets()[k], kjt.capacity_offsets()[k + 1]
    f, b = len(keys), kjt.stride()
    ids = kjt.values()[lo:hi]
    seg = seg_all[lo:hi]
    valid = (seg < f * b) & (ids >= slot.row0) & (ids < slot.row0 + slot.nrows)
    rows = jnp.where(valid, ids - slot.row0 + slot.local_offset, spec.fill).astype(jnp.int32)
    if spec.sequence:
        bag = jnp.arange(hi - lo, dtype=jnp.int32)
    else:
        bag = jnp.clip(seg - k * b, 0, b - 1).astype(jnp.int32)
    w = kjt.weights()[lo:hi].astype(jnp.float32) if spec.weighted else None
    return rows, bag, w, valid


def outbox(kjt: KeyedJaggedTensor, group: WidthGroup, spec: Spec) -> Outbox:
    """Lists this device's ids of ``group`` per destination (see :class:`Outbox`)."""
    seg_all = kjt.segment_ids()
    b, s = spec.bags, spec.slots
    rows, bags, weights, index, slot_index, counts, bag_counts = [], [], [], [], [], [], []
    for slots in group.slots:  # one destination rank at a time (static)
        parts = [_slot_entries(kjt, seg_all, sl, spec) for sl in slots]
        if not parts:
            parts = [
                (
                    jnp.full((1,), spec.fill, jnp.int32),
                    jnp.zeros((1,), jnp.int32),
                    jnp.zeros((1,), jnp.float32),
                    jnp.zeros((1,), bool),
                )
            ]
        valid = jnp.concatenate([p[3] for p in parts])
        idx = jnp.where(valid, jnp.cumsum(valid, dtype=jnp.int32) - 1, -1)
        rows.append(jnp.concatenate([p[0] for p in parts]))
        if spec.sequence:
            bags.append(jnp.concatenate([p[1] for p in parts]))
        else:
            bags.append(jnp.concatenate([j * b + p[1] for j, p in enumerate(parts)]))
        if spec.weighted:
            weights.append(jnp.concatenate([p[2] for p in parts]))
        index.append(idx)
        bounds = [0]
        for p in parts:
            bounds.append(bounds[-1] + p[0].shape[0])
        slot_index.append(tuple(idx[bounds[j] : bounds[j + 1]] for j in range(len(slots))))
        counts.append(jnp.sum(valid, dtype=jnp.int32))
        if spec.by_counts:
            per_bag = jnp.where(valid, bags[-1], s * b)
            bag_counts.append(
                jax.ops.segment_sum(valid.astype(jnp.int32), per_bag, num_segments=s * b)
            )
    return Outbox(
        tuple(rows),
        tuple(bags),
        tuple(weights) if spec.weighted else None,
        tuple(index),
        tuple(slot_index),
        jnp.stack(counts),
        jnp.stack(bag_counts) if spec.by_counts else None,
    )


def round_targets(index: jax.Array, r, capacity: int) -> jax.Array:
    """Position of each entry in round ``r``'s payload, ``capacity`` (dropped) if not in it."""
    t = index - r * capacity
    return jnp.where((index >= 0) & (t >= 0) & (t < capacity), t, capacity)


def send(box: Outbox, spec: Spec, r, axis, *, first: bool) -> jax.Array:
    """Round ``r``'s payloads ``[N, width]`` int32, exchanged: ``[N_src, width]`` received."""
    c = spec.capacity
    out = []
    for p in range(spec.n):
        t = round_targets(box.index[p], r, c)
        parts = [jnp.full((c,), spec.fill, jnp.int32).at[t].set(box.rows[p], mode="drop")]
        if not spec.sequence:
            if spec.by_counts:
                if first:
                    parts.append(box.bag_counts[p])
            else:
                seg = jnp.full((c,), spec.slots * spec.bags, jnp.int32)
                parts.append(seg.at[t].set(box.bags[p], mode="drop"))
        if spec.weighted:
            w = jnp.zeros((c,), jnp.float32).at[t].set(box.weights[p], mode="drop")
            parts.append(jax.lax.bitcast_convert_type(w, jnp.int32))
        out.append(jnp.concatenate(parts))
    return jax.lax.all_to_all(jnp.stack(out), axis, 0, 0, tiled=True)


@dataclasses.dataclass(frozen=True)
class Received:
    """One round's ids on the shard, ``[N_src, C]`` each, indexed by source device."""

    rows: jax.Array  # local rows; fill (out of range) where no id is
    seg: jax.Array | None  # slot * B + bag (S * B where none); None for sequence lookups
    weights: jax.Array | None  # per-sample weights (weighted pooled lookups)
    valid: jax.Array  # rows < fill


def receive(recv: jax.Array, spec: Spec, r, bag_counts: jax.Array | None, *, first: bool):
    """Unpacks round ``r`` (``recv`` from :func:`send`); returns ``(Received, bag_counts)``.

    ``bag_counts`` (``[N_src, S * B]``, counts mode) arrive in round 0 and are
    passed back in for later rounds.
    """
    c, sb = spec.capacity, spec.slots * spec.bags
    rows = recv[:, :c]
    at = c
    seg = None
    if not spec.sequence:
        if spec.by_counts:
            if first:
                bag_counts = recv[:, at : at + sb]
                at += sb
            ends = jnp.cumsum(bag_counts, axis=1)  # [N, S * B]: end of each bag's ids
            d = r * c + jnp.arange(c, dtype=jnp.int32)
            seg = jax.vmap(lambda e: jnp.searchsorted(e, d, side="right"))(ends).astype(jnp.int32)
        else:
            seg = recv[:, at : at + c]
            at += c
        seg = jnp.where(rows < spec.fill, seg, sb)
    weights = None
    if spec.weighted:
        weights = jax.lax.bitcast_convert_type(recv[:, at : at + c], jnp.float32)
    return Received(rows, seg, weights, rows < spec.fill), bag_counts


def rounds_needed(counts: jax.Array, capacity: int) -> jax.Array:
    """Rounds this device needs for one group: ``max_p ceil(counts[p] / C)``, at least 1."""
    return jnp.maximum(jnp.max((counts + capacity - 1) // capacity), 1)


def beyond(counts: jax.Array, capacity: int) -> jax.Array:
    """Ids this device sends past round 0 (what a drop mode loses)."""
    return jnp.sum(jnp.maximum(counts - capacity, 0))
