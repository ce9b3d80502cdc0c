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
import numpy as np

from ..sparse import KeyedJaggedTensor
from ..xla.slots import slot_bag_starts
from .layout import WidthGroup


@dataclasses.dataclass(frozen=True)
class Outbox:
    """A source's ids for one width group, per destination (lists of length ``N``).

    ``rows[p]``, ``bags[p]``, ``weights[p]`` and ``index[p]`` are ``[L_p]``
    (``bags`` for pooled lookups, ``weights`` for weighted ones)
    (every candidate entry of destination ``p``'s slots, concatenated); an
    entry is sent iff ``index[p] >= 0`` (its payload index). ``slot_index[p][j]``
    is the part of ``index[p]`` that belongs to slot ``j`` (``[cap of its key]``).
    """

    rows: tuple[jax.Array, ...]
    bags: tuple[jax.Array, ...] | None  # slot * B + bag
    weights: tuple[jax.Array, ...] | None
    index: tuple[jax.Array, ...]
    slot_index: tuple[tuple[jax.Array, ...], ...]
    counts: jax.Array  # [N] ids per destination
    bag_counts: jax.Array | None  # [N, S * B] ids per (slot, bag), pooled only
    # round 0 as received ([N_src, width]) when sent a step ahead (see input_dist.py)
    ahead: jax.Array | None = None


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
    ragged: bool = False  # ragged_all_to_all: send only the ids there are (GPU)
    # VBE: (slot, bag) pairs of the rank with the most, sum_j B_j (its slots' strides);
    # None: S * B
    vbe_bags: int | None = None

    @property
    def sb(self) -> int:
        """Output blocks' (slot, bag) rows per source: ``S * B``, or VBE's ``vbe_bags``."""
        return self.slots * self.bags if self.vbe_bags is None else self.vbe_bags

    @property
    def by_counts(self) -> bool:
        """Pooled payloads locate bags by counts when ``S * B <= C``, else by segments."""
        return not self.sequence and self.sb <= self.capacity

    @property
    def segments(self) -> bool:
        """Pooled payloads without counts carry one segment per id."""
        return not self.sequence and not self.by_counts

    def per_id(self) -> int:
        """int32 words per id: its row, its segment (unless by counts), its weight."""
        return 1 + int(self.segments) + int(self.weighted)

    def meta(self, first: bool) -> int:
        """int32 words before the ids: the per-(slot, bag) counts, in round 0."""
        return self.sb if self.by_counts and first else 0

    def width(self, first: bool) -> int:
        """int32 words per destination of round 0 (``first``) or a later round."""
        return self.meta(first) + self.capacity * self.per_id()


def _entry_tables(kjt: KeyedJaggedTensor, group: WidthGroup):
    """Static per-entry arrays of every destination's candidate entries, concatenated.

    Destination ``p``'s entries are the value positions of its slots' keys, slot by
    slot; each carries its slot's row range and local offset, its key and its slot
    number. Built with numpy once per trace: the exchange then costs a few array
    ops per group, however many tables and features the group holds.
    """
    offsets = kjt.capacity_offsets()
    keys = {k: i for i, k in enumerate(kjt.keys())}
    bag0, spk = kjt.bag_offsets(), kjt.stride_per_key()
    names = ("pos", "row0", "end", "off", "key", "slot", "dest", "sbag0", "kbag0", "nb")
    cols = {name: [] for name in names}
    for p, slots in enumerate(group.slots):
        starts = slot_bag_starts(kjt, slots)
        for j, sl in enumerate(slots):
            k = keys[sl.key]
            n = offsets[k + 1] - offsets[k]
            cols["pos"].append(np.arange(offsets[k], offsets[k + 1]))
            for name, v in (
                ("row0", sl.row0),
                ("end", sl.row0 + sl.nrows),
                ("off", sl.local_offset),
                ("key", k),
                ("slot", j),
                ("dest", p),
                ("sbag0", starts[j]),  # the slot's first (slot, bag) row: j * B without VBE
                ("kbag0", bag0[k]),  # the key's first bag in the KJT
                ("nb", max(spk[k], 1)),  # the key's bags (its stride)
            ):
                cols[name].append(np.full(n, v))
    return {
        k: np.concatenate(v).astype(np.int32) if v else np.zeros(0, np.int32)
        for k, v in cols.items()
    }


def outbox(kjt: KeyedJaggedTensor, group: WidthGroup, spec: Spec) -> Outbox:
    """Lists this device's ids of ``group`` per destination (see :class:`Outbox`)."""
    e = _entry_tables(kjt, group)
    sb, s, n = spec.sb, spec.slots, spec.n
    ids = jnp.take(kjt.values(), e["pos"])
    seg = jnp.take(kjt.segment_ids(), e["pos"])
    # Row bounds in the ids' own dtype: mixing uint32 ids with int32 would promote.
    row0, end = e["row0"].astype(ids.dtype), e["end"].astype(ids.dtype)
    valid = (seg < kjt.bag_offsets()[-1]) & (ids >= row0) & (ids < end)
    local = (ids - row0).astype(jnp.int32) + e["off"]
    rows = jnp.where(valid, local, spec.fill).astype(jnp.int32)
    bags = e["sbag0"] + jnp.clip(seg - e["kbag0"], 0, e["nb"] - 1).astype(jnp.int32)
    weights = jnp.take(kjt.weights(), e["pos"]).astype(jnp.float32) if spec.weighted else None
    # Payload index: the entry's rank among its destination's valid entries.
    counts = jax.ops.segment_sum(valid.astype(jnp.int32), e["dest"], num_segments=n)
    before = jnp.cumsum(counts) - counts
    idx = jnp.cumsum(valid, dtype=jnp.int32) - 1 - jnp.take(before, e["dest"])
    idx = jnp.where(valid, idx, -1)
    bounds = np.searchsorted(e["dest"], np.arange(n + 1))  # each destination's entries
    part = lambda x: tuple(x[bounds[p] : bounds[p + 1]] for p in range(n))  # noqa: E731
    bag_counts = None
    if spec.by_counts:
        per_bag = jnp.where(valid, e["dest"] * sb + bags, n * sb)
        bag_counts = jax.ops.segment_sum(
            valid.astype(jnp.int32), per_bag, num_segments=n * sb
        ).reshape(n, sb)
    slot_index = ()
    if spec.sequence:  # the sequence path puts rows back slot by slot
        first = np.searchsorted(e["dest"] * (s + 1) + e["slot"], np.arange(n * (s + 1)))
        slot_index = tuple(
            tuple(
                idx[first[p * (s + 1) + j] : first[p * (s + 1) + j + 1]]
                for j in range(len(group.slots[p]))
            )
            for p in range(n)
        )
    return Outbox(
        part(rows),
        None if spec.sequence else part(bags),
        part(weights) if spec.weighted else None,
        part(idx),
        slot_index,
        counts,
        bag_counts,
    )


def round_targets(index: jax.Array, r, capacity: int) -> jax.Array:
    """Position of each entry in round ``r``'s payload, ``capacity`` (dropped) if not in it."""
    t = index - r * capacity
    return jnp.where((index >= 0) & (t >= 0) & (t < capacity), t, capacity)


def send(box: Outbox, spec: Spec, r, axis, *, first: bool) -> jax.Array:
    """Round ``r``'s payloads, exchanged: ``[N_src, width]`` int32 received.

    A destination's payload is the counts (round 0, counts mode), then ``C``
    ids of ``per_id`` words each (row, segment, weight bits), so the ids there
    are form a prefix: a ragged exchange sends just that prefix.
    """
    c, m = spec.capacity, spec.meta(first)
    out = []
    for p in range(spec.n):
        t = round_targets(box.index[p], r, c)
        cols = [jnp.full((c,), spec.fill, jnp.int32).at[t].set(box.rows[p], mode="drop")]
        if spec.segments:
            assert box.bags is not None  # a pooled outbox (segments are pooled only)
            seg = jnp.full((c,), spec.sb, jnp.int32)
            cols.append(seg.at[t].set(box.bags[p], mode="drop"))
        if spec.weighted:
            assert box.weights is not None  # outbox() keeps weights iff spec.weighted
            w = jnp.zeros((c,), jnp.float32).at[t].set(box.weights[p], mode="drop")
            cols.append(jax.lax.bitcast_convert_type(w, jnp.int32))
        ids = jnp.stack(cols, axis=1).reshape(-1)
        if m:
            assert box.bag_counts is not None  # outbox() counts bags iff spec.by_counts
            ids = jnp.concatenate([box.bag_counts[p], ids])
        out.append(ids)
    payload = jnp.stack(out)
    if not spec.ragged:
        return jax.lax.all_to_all(payload, axis, 0, 0, tiled=True)
    return _ragged(payload, empty(spec, first), box.counts, spec, r, axis, m)


def empty(spec: Spec, first: bool) -> jax.Array:
    """``[width]``: what a destination's payload holds where no id is."""
    one = [spec.fill]
    if spec.segments:
        one.append(spec.sb)
    if spec.weighted:
        one.append(0)  # the bits of 0.0
    ids = jnp.tile(jnp.asarray(one, jnp.int32), spec.capacity)
    return jnp.concatenate([jnp.zeros((spec.meta(first),), jnp.int32), ids])


def _ragged(payload, empty, counts, spec: Spec, r, axis, meta: int) -> jax.Array:
    """The exchange of :func:`send` moving only each payload's prefix of real ids."""
    n, width = payload.shape
    sent = jnp.clip(counts - r * spec.capacity, 0, spec.capacity).astype(jnp.int32)
    sizes = meta + spec.per_id() * sent
    recv_sizes = jax.lax.all_to_all(sizes, axis, 0, 0, tiled=True)
    me = jax.lax.axis_index(axis).astype(jnp.int32)
    starts = jnp.arange(n, dtype=jnp.int32) * width
    got = jax.lax.ragged_all_to_all(
        payload.reshape(-1),
        jnp.tile(empty, n),
        starts,
        sizes,
        jnp.full((n,), me * width, jnp.int32),
        recv_sizes,
        axis_name=axis,
    )
    return got.reshape(n, width)


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
    c, m, sb = spec.capacity, spec.meta(first), spec.sb
    if m:
        bag_counts = recv[:, :m]
    ids = recv[:, m:].reshape(recv.shape[0], c, spec.per_id())
    rows = ids[:, :, 0]
    seg = None
    if not spec.sequence:
        if not spec.segments:
            if bag_counts is None:
                raise ValueError(
                    f"receive: round {r} of a counts-mode exchange needs round 0's bag_counts"
                )
            ends = jnp.cumsum(bag_counts, axis=1)  # [N, S * B]: end of each bag's ids
            d = r * c + jnp.arange(c, dtype=jnp.int32)
            seg = jax.vmap(lambda e: jnp.searchsorted(e, d, side="right"))(ends).astype(jnp.int32)
        else:
            seg = ids[:, :, 1]
        seg = jnp.where(rows < spec.fill, seg, sb)
    weights = None
    if spec.weighted:
        weights = jax.lax.bitcast_convert_type(ids[:, :, -1], jnp.float32)
    return Received(rows, seg, weights, rows < spec.fill), bag_counts


def rounds_needed(counts: jax.Array, capacity: int) -> jax.Array:
    """Rounds this device needs for one group: ``max_p ceil(counts[p] / C)``, at least 1."""
    return jnp.maximum(jnp.max((counts + capacity - 1) // capacity), 1)


def beyond(counts: jax.Array, capacity: int) -> jax.Array:
    """Ids this device sends past round 0 (what a drop mode loses)."""
    return jnp.sum(jnp.maximum(counts - capacity, 0))
