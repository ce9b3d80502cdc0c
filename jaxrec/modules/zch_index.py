"""The hash index of a dynamic table: 64-bit ids -> slots, as pure static-shape programs.

A dynamic table has ``S`` slots (its rows), cut into buckets of ``W`` ways.
An id's bucket is named by its 64-bit hash (:func:`~jaxrec.sparse.ids64.hash64_words`,
high word modulo the table's total bucket count); the id may sit in any way
of its bucket. So a lookup reads ``W`` keys per id (O(1), no sort of the
table), and every bucket is independent of the others: an index of buckets
``[b0, b1)`` is a row block of the global one, which is how a sharded table
splits it (row-wise, by the id's hash) and why a checkpoint of the global
arrays restores under any world size that divides the bucket count.

::

    id (lo, hi) --hash64--> bucket g = h_hi % total_buckets --> ways [g*W, g*W + W)
      hit:  the way holding the id            -> row = row_offset + slot
      miss: admitted?  -> a free way, else the policy's victim (not used in this call)
            rejected   -> FILL (out of range: reads zeros, trains nothing)

One training call (:func:`train_step`) of ids ``[C]``:

1. every valid id reads its bucket; hits stamp their slot (``last_seen = now``,
   ``counts += 1`` per occurrence);
2. the distinct missed ids, sorted by (bucket, id), pass the admission policy
   (a count-min sketch of sightings, or a per-id coin from the hash);
3. the ``r``-th admitted id of a bucket takes the ``r``-th way of the bucket's
   candidates: free ways first (lowest first), then evictable ones in the
   policy's order; ways hit or filled in this call are never taken; an id
   without a candidate is rejected for this call;
4. the taken ways get the id, ``last_seen = now``, ``counts`` = its
   occurrences; ways that held an id are *evicted*: their rows come out
   (packed, ``FILL``-padded) so the caller resets the row and its optimizer state.

Every decision depends on the call's set of ids (with multiplicities), never on
their order, so a sharded table (ids arrive from many devices) decides
exactly what the unsharded one decides on the global batch.

State per slot: id words (2 x uint32), ``last_seen`` (int32, -1 = empty),
``counts`` (int32), plus with :class:`~jaxrec.modules.zch_policies.FrequencyAdmission`
one int32 sketch cell: 16 bytes a slot (20 with the sketch).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from ..cpu import zch as cpu_zch
from ..ops import dispatch
from ..sparse.ids64 import hash64_words
from .zch_policies import (
    Admission,
    FrequencyAdmission,
    HashZchEvictionConfig,
    HashZchEvictionPolicyName,
    ProbabilityAdmission,
)

FILL = 2**31 - 1  # the row of a rejected id and of unused evicted entries (out of range)
INDEX_BYTES_PER_SLOT = 16  # id words, last_seen, counts
SKETCH_BYTES_PER_SLOT = 4
_FREE, _EVICTABLE, _TAKEN = 0, 1, 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZchLayout:
    """Static shape and policy of one index (a whole table or one shard's block of it).

    Args:
        slots: slots of this index (``S``), a multiple of ``ways``.
        ways: slots per bucket (``W``).
        total_buckets: buckets of the whole table (the hash's modulus).
        bucket_offset: the global bucket of this index's first bucket.
        row_offset: the global row of this index's first slot.
        seed: the id hash's seed.
        eviction: the eviction policy.
        admission: ``None`` (admit every id), or a policy.
        implementation: ``None`` (the C++ kernel where lowered for CPU, if built) or
            ``"xla"`` (the XLA program everywhere: what ``jax.export`` can serialize).
    """

    slots: int
    ways: int
    total_buckets: int
    bucket_offset: int = 0
    row_offset: int = 0
    seed: int = 0
    eviction: HashZchEvictionConfig = HashZchEvictionConfig()
    admission: Admission = None
    implementation: str | None = None  # "xla": never the C++ kernel (e.g. for jax.export)

    def __post_init__(self):
        if self.implementation not in (None, "xla"):
            raise ValueError(f"implementation must be None or 'xla', got {self.implementation!r}")
        if self.ways < 1 or self.slots < self.ways or self.slots % self.ways:
            raise ValueError(
                f"slots ({self.slots}) must be a positive multiple of ways ({self.ways})"
            )
        if self.bucket_offset + self.buckets > self.total_buckets:
            raise ValueError(
                f"buckets [{self.bucket_offset}, {self.bucket_offset + self.buckets}) exceed "
                f"total_buckets={self.total_buckets}"
            )

    @property
    def buckets(self) -> int:
        return self.slots // self.ways

    @property
    def sketch_size(self) -> int:
        return self.slots if isinstance(self.admission, FrequencyAdmission) else 0


class ZchState(NamedTuple):
    """Arrays of one index (``S`` slots); every field changes only in training calls."""

    id_lo: jax.Array  # [S] uint32 low words of the ids held
    id_hi: jax.Array  # [S] uint32 high words
    last_seen: jax.Array  # [S] int32 training call of the last use; -1: empty
    counts: jax.Array  # [S] int32 uses since the id took the slot
    sketch: jax.Array  # [S] (FrequencyAdmission) or [0] int32 sightings of ids without a slot
    current_iter: jax.Array  # int32 scalar: training calls so far
    occupancy: jax.Array  # int32 scalar: slots holding an id


class ZchCounts(NamedTuple):
    """One training call's counters (int32 scalars): distinct ids."""

    admitted: jax.Array  # took a slot
    evicted: jax.Array  # were pushed out of their slot by them
    rejected: jax.Array  # missed and got no slot (admission, or a bucket of live ways)


class ZchStep(NamedTuple):
    state: ZchState
    rows: jax.Array  # [C] int32 global rows; FILL for rejected, invalid and padding
    evicted: jax.Array  # [E] int32 global rows evicted by this call, FILL-padded
    counts: ZchCounts


def empty_state(layout: ZchLayout) -> ZchState:
    s = layout.slots
    return ZchState(
        id_lo=jnp.zeros((s,), jnp.uint32),
        id_hi=jnp.zeros((s,), jnp.uint32),
        last_seen=jnp.full((s,), -1, jnp.int32),
        counts=jnp.zeros((s,), jnp.int32),
        sketch=jnp.zeros((layout.sketch_size,), jnp.int32),
        current_iter=jnp.zeros((), jnp.int32),  # distinct buffers: a train step donates each
        occupancy=jnp.zeros((), jnp.int32),
    )


def buckets_of(layout: ZchLayout, lo: jax.Array, hi: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(global bucket int32, hash low word uint32)`` of ids given as words."""
    h_lo, h_hi = hash64_words(lo, hi, seed=layout.seed)
    return (h_hi % jnp.uint32(layout.total_buckets)).astype(jnp.int32), h_lo


class _Lookup(NamedTuple):
    valid: jax.Array  # [C] real ids of this index's buckets
    bucket: jax.Array  # [C] local bucket (0 where invalid)
    h_lo: jax.Array  # [C] the hash's low word (admission, sketch cells)
    hit: jax.Array  # [C]
    slot: jax.Array  # [C] local slot of a hit


def _lookup(layout: ZchLayout, state: ZchState, lo, hi, valid) -> _Lookup:
    g, h_lo = buckets_of(layout, lo, hi)
    b = g - layout.bucket_offset
    valid = valid & (b >= 0) & (b < layout.buckets)
    b = jnp.where(valid, b, 0)
    ways = jnp.arange(layout.ways, dtype=jnp.int32)
    cand = b[:, None] * layout.ways + ways  # [C, W]
    match = (
        (state.last_seen[cand] >= 0)
        & (state.id_lo[cand] == lo[:, None])
        & (state.id_hi[cand] == hi[:, None])
    )
    hit = valid & jnp.any(match, axis=1)
    slot = b * layout.ways + jnp.argmax(match, axis=1).astype(jnp.int32)
    return _Lookup(valid, b, h_lo, hit, slot)


def remap(layout: ZchLayout, state: ZchState, lo, hi, valid) -> jax.Array:
    """Eval: ``[C]`` rows of the ids held, ``FILL`` for the others; no state change.

    Run by the C++ kernel (``jaxrec.cpu.zch``) where the program is lowered for CPU and
    the kernel is built, by :func:`remap_xla` elsewhere (chosen per lowering platform:
    a CPU host still compiles the XLA program for GPUs); the same rows either way.
    """
    if layout.implementation == "xla" or not _kernel_ready():
        return remap_xla(layout, state, lo, hi, valid)

    def run(platform):
        if platform != "cpu":
            return remap_xla(layout, state, lo, hi, valid)
        k = _kernel_layout(layout)
        return cpu_zch.remap_cpu(k, state.id_lo, state.id_hi, state.last_seen, lo, hi, valid)

    return dispatch.by_platform(run, inputs=(state, lo, hi, valid))


def remap_xla(layout: ZchLayout, state: ZchState, lo, hi, valid) -> jax.Array:
    """:func:`remap` as an XLA program (every platform)."""
    look = _lookup(layout, state, lo, hi, valid)
    return jnp.where(look.hit, layout.row_offset + look.slot, FILL).astype(jnp.int32)


def _sketch_cells(layout: ZchLayout, bucket, h_lo) -> tuple[jax.Array, jax.Array]:
    """Two distinct cells (when ``W > 1``) of the id's bucket."""
    w = jnp.uint32(layout.ways)
    first = h_lo % w
    step = jnp.uint32(1) + (h_lo >> jnp.uint32(16)) % jnp.maximum(w - 1, 1)
    second = (first + step) % w if layout.ways > 1 else first
    base = bucket * layout.ways
    return base + first.astype(jnp.int32), base + second.astype(jnp.int32)


def _pick(layout: ZchLayout, last_seen, counts, bucket, rank, now) -> tuple[jax.Array, jax.Array]:
    """The ``rank``-th way of each entry's bucket in take order: ``(class [C], way [C])``.

    Take order is (class, policy keys, way): free ways, then evictable ones by the
    policy, then taken ones. No sort: each way's place is the number of ways
    before it (``[C, W, W]`` compares), and the way whose place is ``rank`` is picked.
    """
    w = layout.ways
    ways = jnp.arange(w, dtype=jnp.int32)
    cells = bucket[:, None] * w + ways
    seen, uses = last_seen[cells], counts[cells]
    free, busy = seen < 0, seen == now
    policy = layout.eviction.policy
    if policy is HashZchEvictionPolicyName.SINGLE_TTL_EVICTION:
        expired = now - seen > layout.eviction.single_ttl
        cls = jnp.where(free, _FREE, jnp.where(expired & ~busy, _EVICTABLE, _TAKEN))
        keys = (cls, seen)
    else:
        cls = jnp.where(free, _FREE, jnp.where(busy, _TAKEN, _EVICTABLE))
        lfu = policy is HashZchEvictionPolicyName.LFU_EVICTION
        keys = (cls, uses, seen) if lfu else (cls, seen)
    way = jnp.broadcast_to(ways, cls.shape)
    before = way[:, :, None] < way[:, None, :]  # [C, i, j]: way i before way j by the last key
    for k in reversed(keys):  # lexicographic, most significant key last
        a, b = k[:, :, None], k[:, None, :]
        before = (a < b) | ((a == b) & before)
    place = jnp.sum(before, axis=1, dtype=jnp.int32)  # [C, j]: ways before way j
    hit = place == jnp.minimum(rank, w - 1)[:, None]
    pick = jnp.argmax(hit, axis=1).astype(jnp.int32)
    return jnp.take_along_axis(cls, pick[:, None], axis=1)[:, 0], pick


def _admit(layout: ZchLayout, head, occurrences, bucket, h_lo, sketch):
    """Which distinct missed ids may take a slot, and the updated sketch."""
    adm = layout.admission
    if isinstance(adm, FrequencyAdmission):
        c1, c2 = _sketch_cells(layout, bucket, h_lo)
        drop = layout.slots
        add = jnp.where(head, occurrences, 0)
        sketch = sketch.at[jnp.where(head, c1, drop)].add(add, mode="drop")
        sketch = sketch.at[jnp.where(head & (c2 != c1), c2, drop)].add(add, mode="drop")
        return head & (jnp.minimum(sketch[c1], sketch[c2]) >= adm.threshold), sketch
    if isinstance(adm, ProbabilityAdmission):
        cut = adm.cutoff()
        return (head if cut >= 2**32 else head & (h_lo < jnp.uint32(cut))), sketch
    return head, sketch


def train_step(layout: ZchLayout, state: ZchState, lo, hi, valid, *, max_evictions: int) -> ZchStep:
    """One training call on ids ``[C]`` (words ``lo``, ``hi``; ``valid`` masks padding).

    See the module docs for the rules. ``max_evictions`` (static) sizes the
    evicted rows: ``>= C`` never drops one and keeps each evicted row at its id's
    place in (bucket, id) order, ``FILL`` elsewhere; below ``C`` they are packed
    at the front (``min(C, S)`` still never drops one).

    Run by the C++ kernel (``jaxrec.cpu.zch``: the same outputs bit for bit, the
    state updated in place when donated) where the program is lowered for CPU and
    the kernel is built, by :func:`train_step_xla` elsewhere (chosen per lowering
    platform: a CPU host still compiles the XLA program for GPUs).
    """
    if layout.implementation == "xla" or not _kernel_ready():
        return train_step_xla(layout, state, lo, hi, valid, max_evictions=max_evictions)

    def run(platform):
        if platform != "cpu":
            return train_step_xla(layout, state, lo, hi, valid, max_evictions=max_evictions)
        k = _kernel_layout(layout)
        out = cpu_zch.train_step_cpu(k, tuple(state), lo, hi, valid, max_evictions=max_evictions)
        tally = ZchCounts(out.counts[0], out.counts[1], out.counts[2])
        return ZchStep(ZchState(*out.state), out.rows, out.evicted, tally)

    return dispatch.by_platform(run, inputs=(state, lo, hi, valid))


def _kernel_ready() -> bool:
    """Whether ``implementation=None`` picks C++ on CPU and the kernels are registered."""
    return dispatch.CPU_BY_DEFAULT and cpu_zch.ready()


def _kernel_layout(layout: ZchLayout) -> cpu_zch.ZchKernelLayout:
    """The layout as the C++ kernels' attributes."""
    ev, adm = layout.eviction, layout.admission
    policies: dict[HashZchEvictionPolicyName, Literal["lru", "lfu", "ttl"]] = {
        HashZchEvictionPolicyName.LRU_EVICTION: "lru",
        HashZchEvictionPolicyName.LFU_EVICTION: "lfu",
        HashZchEvictionPolicyName.SINGLE_TTL_EVICTION: "ttl",
    }
    kernel = cpu_zch.ZchKernelLayout(
        slots=layout.slots,
        ways=layout.ways,
        total_buckets=layout.total_buckets,
        bucket_offset=layout.bucket_offset,
        row_offset=layout.row_offset,
        seed=layout.seed,
        policy=policies[ev.policy],
        single_ttl=ev.single_ttl or 0,
    )
    if isinstance(adm, FrequencyAdmission):
        return dataclasses.replace(kernel, admission="frequency", threshold=adm.threshold)
    if isinstance(adm, ProbabilityAdmission):
        return dataclasses.replace(kernel, admission="probability", cutoff=adm.cutoff())
    return kernel


def train_step_xla(
    layout: ZchLayout, state: ZchState, lo, hi, valid, *, max_evictions: int
) -> ZchStep:
    """:func:`train_step` as an XLA program (every platform)."""
    c, s, w = lo.shape[0], layout.slots, layout.ways
    now = state.current_iter + 1
    look = _lookup(layout, state, lo, hi, valid)
    at_hit = jnp.where(look.hit, look.slot, s)
    last_seen = state.last_seen.at[at_hit].set(now, mode="drop")
    counts = state.counts.at[at_hit].add(1, mode="drop")

    # distinct misses in (bucket, hi, lo) order; everything else sorts after them
    miss = look.valid & ~look.hit
    idx = jnp.arange(c, dtype=jnp.int32)
    key = jnp.where(miss, look.bucket, layout.buckets)  # the rest sort after the misses
    b, shi, slo, order = jax.lax.sort((key, hi, lo, idx), num_keys=3)
    m = b < layout.buckets
    b = jnp.minimum(b, layout.buckets - 1)  # entries past the misses: any bucket, unused
    first = idx == 0
    prev = lambda x: jnp.roll(x, 1)  # noqa: E731
    new_bucket = first | (b != prev(b))
    head = m & (new_bucket | (shi != prev(shi)) | (slo != prev(slo)))
    seg = jnp.cumsum(head.astype(jnp.int32)) - 1
    seg_at = jnp.where(m, seg, c)
    occ = jnp.zeros((c,), jnp.int32).at[seg_at].add(1, mode="drop")[jnp.maximum(seg, 0)]

    admit, sketch = _admit(layout, head, occ, b, look.h_lo[order], state.sketch)
    a = admit.astype(jnp.int32)
    before = jnp.cumsum(a) - a  # admitted entries before this one
    start = jax.lax.cummax(jnp.where(new_bucket, before, 0))
    rank = before - start
    cls_pick, way_pick = _pick(layout, last_seen, counts, b, rank, now)
    ok = admit & (rank < w) & (cls_pick != _TAKEN)
    new_slot = b * w + way_pick
    evicted = ok & (cls_pick == _EVICTABLE)

    at_new = jnp.where(ok, new_slot, s)
    id_lo = state.id_lo.at[at_new].set(slo, mode="drop")
    id_hi = state.id_hi.at[at_new].set(shi, mode="drop")
    last_seen = last_seen.at[at_new].set(now, mode="drop")
    counts = counts.at[at_new].set(occ, mode="drop")

    # every occurrence of a missed id gets its head's slot (or none), in input order
    head_slot = (
        jnp.full((c,), -1, jnp.int32)
        .at[jnp.where(head, seg, c)]
        .set(jnp.where(ok, new_slot, -1), mode="drop")
    )
    sorted_slot = jnp.where(m, head_slot[jnp.maximum(seg, 0)], -1)
    miss_slot = jnp.zeros((c,), jnp.int32).at[order].set(sorted_slot)
    slot = jnp.where(look.hit, look.slot, jnp.where(miss, miss_slot, -1))
    rows = jnp.where(slot >= 0, layout.row_offset + slot, FILL).astype(jnp.int32)

    ev_rows = jnp.where(evicted, layout.row_offset + new_slot, FILL)  # [C], in sorted order
    if max_evictions >= c:  # no compaction (a prefix-sum program XLA:CPU compiles slowly)
        ev_rows = jnp.concatenate([ev_rows, jnp.full((max_evictions - c,), FILL, jnp.int32)])
    else:
        (pos,) = jnp.nonzero(evicted, size=max_evictions, fill_value=c)
        ev_rows = jnp.where(pos < c, ev_rows[jnp.minimum(pos, c - 1)], FILL)

    filled = jnp.sum(ok & (cls_pick == _FREE), dtype=jnp.int32)
    n_ev = jnp.sum(evicted, dtype=jnp.int32)
    new_state = ZchState(id_lo, id_hi, last_seen, counts, sketch, now, state.occupancy + filled)
    tally = ZchCounts(
        admitted=jnp.sum(ok, dtype=jnp.int32),
        evicted=n_ev,
        rejected=jnp.sum(head & ~ok, dtype=jnp.int32),
    )
    return ZchStep(new_state, rows, ev_rows.astype(jnp.int32), tally)
