"""The slot map on the device: a set-associative cache state and one step's plan.

FBGEMM keeps a cache's state on the GPU (``lxu_cache_state``, ``lru_state``,
``lfu_state``) and finds, replaces and rewrites ids there (``lxu_cache_lookup``,
``lru_cache_populate`` / ``lfu_cache_populate``). This module is that, as arrays
and one pure function that ``jax.jit`` compiles for any backend:

- a row shard's ``slots`` are cut into ``sets`` of up to :data:`WAYS` (32, as
  FBGEMM on NVIDIA GPUs) consecutive slots, as equal as they divide; a row may
  only sit in the set its hash picks (a cache of at most 32 slots is one set:
  fully associative). Memory: 8 bytes per slot (its row, its last use), and with
  LFU 4 bytes per row (each row's count since the start: FBGEMM's ``lfu_state``
  is 8), never the table;
- :func:`plan_sets` takes a batch's ids of one table and, in one program, finds
  the cached rows (hits), gives each distinct missed row a slot of its set, the
  victims being the set's slots the batch does not use (never used first, then
  LRU: the one used longest ago; LFU: the row looked up least often, then the
  one used longest ago; ties: the lowest slot), and rewrites every id as its
  slot. The missed rows are taken in (set, row) order. It lists the fills
  and the evictions (each a slot and a logical row) for the rows to move;
- a batch whose rows do not fit (a set would need more slots than it has) is
  refused: ``overflow`` is set and the state returned is the one given.

``SlotState`` is what :func:`plan_sets` takes and returns (donate it). The tests'
oracle is a plain loop over the same rules (``tests/cache/sets_reference.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..cpu import loader
from ..distributed.types import CacheAlgorithm
from ..ops import dispatch

WAYS = 32  # FBGEMM's associativity on NVIDIA GPUs (``kWarpSize``)
_MAX = np.iinfo(np.int32).max


class SetLayout(NamedTuple):
    """The static shape of a table's slot map (hashable: a ``jax.jit`` static argument).

    ``rows`` logical rows in ``shards`` row shards of ``shard_rows`` (the last may be
    shorter), each with ``slots`` slots in ``sets`` sets: set ``h`` of a shard holds
    its slots ``[h*q + min(h, r), ...)``, ``q + (h < r)`` of them (``q, r =
    divmod(slots, sets)``)."""

    rows: int
    shard_rows: int
    shards: int
    slots: int  # per shard
    sets: int  # per shard
    algorithm: CacheAlgorithm

    @property
    def ways(self) -> int:
        """Slots of the largest set."""
        return -(-self.slots // self.sets)

    @property
    def total_slots(self) -> int:
        return self.shards * self.slots


def set_layout(rows: int, shards: int, slots: int, algorithm: CacheAlgorithm) -> SetLayout:
    """The layout of a table of ``rows`` rows in ``shards`` row shards of ``slots`` slots."""
    if slots < 1 or shards < 1:
        raise ValueError(f"a cache needs slots and shards, got {slots} slots, {shards} shards")
    if shards * slots > _MAX or rows > _MAX:
        raise ValueError(
            f"{rows} rows and {shards} x {slots} slots exceed the int32 slot map: shard the "
            "table over more processes or lower CacheParams.load_factor"
        )
    return SetLayout(
        rows, -(-rows // shards), shards, slots, -(-slots // WAYS), CacheAlgorithm(algorithm)
    )


class SlotState(NamedTuple):
    """A table's slot map (device arrays; FBGEMM's ``lxu_cache_state``, ``lru_state``,
    ``lfu_state``)."""

    rows: jax.Array  # int32 [total_slots]: the shard-local row each slot holds, -1 none
    stamps: jax.Array  # int32 [total_slots]: the step that last used it, 0 never
    counts: jax.Array  # int32 [rows] (LFU; [0] for LRU): lookups since the start, saturating
    clock: jax.Array  # int32 []: steps planned


def empty_state(layout: SetLayout) -> SlotState:
    n = layout.total_slots
    lfu = layout.algorithm is CacheAlgorithm.LFU
    return SlotState(
        jnp.full((n,), -1, jnp.int32),
        jnp.zeros((n,), jnp.int32),
        jnp.zeros((layout.rows if lfu else 0,), jnp.int32),
        jnp.zeros((), jnp.int32),
    )


class SetPlan(NamedTuple):
    """One batch's plan (:func:`plan_sets`). Moves are packed at the front in (set, row)
    order; an eviction's slot is refilled by the fill of the same slot."""

    state: SlotState  # after the batch (the one given when ``overflow``)
    slots: jax.Array  # int32 [N]: each valid id's slot in the table (every shard's slots
    #   in a row); -1 for ids < 0, total_slots for ids >= rows; other entries unchanged
    fill_slots: jax.Array  # int32 [N], first ``n_fill``: slots that receive a missed row
    fill_rows: jax.Array  # int32 [N]: those rows (logical)
    evict_slots: jax.Array  # int32 [N], first ``n_evict``: slots whose row goes back first
    evict_rows: jax.Array  # int32 [N]: those rows (logical)
    n_fill: jax.Array  # int32 []
    n_evict: jax.Array  # int32 []
    n_ids: jax.Array  # int32 []: valid ids in range
    n_rows: jax.Array  # int32 []: distinct rows among them
    overflow: jax.Array  # bool []: the batch does not fit; nothing changed


def set_hash(x: jax.Array) -> jax.Array:
    """A 32-bit integer mix (uint32 in, uint32 out): neighbouring rows land in
    unrelated sets."""
    x = x.astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _set_of(layout: SetLayout, local: jax.Array, shard: jax.Array):
    """``(first slot, slots)`` of each row's set (table-wide slot numbers)."""
    h = (set_hash(local) % jnp.uint32(layout.sets)).astype(jnp.int32)
    q, r = divmod(layout.slots, layout.sets)
    start = shard * layout.slots + h * q + jnp.minimum(h, r)
    return start, q + (h < r).astype(jnp.int32)


def plan_sets(layout: SetLayout, state: SlotState, ids: jax.Array, valid: jax.Array) -> SetPlan:
    """The plan of one batch's ids of a table (``ids`` int32 [N], logical rows; only
    entries with ``valid`` are looked up, the rest are padding). Pure: ``jax.jit`` it
    with ``layout`` static (and ``state`` donated)."""
    return _commit(layout, state, _decide(layout, state, ids, valid), None)


def plan_sets_many(
    layouts: Sequence[SetLayout],
    states: Sequence[SlotState],
    ids: Sequence[jax.Array],
    valid: Sequence[jax.Array],
) -> list[SetPlan]:
    """:func:`plan_sets` of several tables' ids in one program, all kept or none: when
    any table's batch does not fit (its ``overflow``), every state is the one given
    (put back in place: no copy of a state is made)."""
    decided = [_decide(*x) for x in zip(layouts, states, ids, valid, strict=True)]
    refused = jnp.any(jnp.stack([d.overflow for d in decided]))
    return [
        _commit(lay, st, d, refused) for lay, st, d in zip(layouts, states, decided, strict=True)
    ]


class _Decided(NamedTuple):
    """A batch's plan before it is kept or refused (:func:`_decide`)."""

    stamps: jax.Array  # the hits and fills stamped now (in place)
    hit: jax.Array
    hit_slot: jax.Array
    hit_stamp: jax.Array  # the hits' stamps before
    v_slot: jax.Array  # each distinct miss's slot (total past them)
    fill_stamp: jax.Array  # those slots' stamps before the fills
    fill_row: jax.Array  # the missed rows (shard-local)
    counted: jax.Array  # the ids in range
    row: jax.Array  # each id's row (0 where not counted)
    clock: jax.Array
    overflow: jax.Array
    plan: SetPlan  # its outputs (state: the one given, to be replaced)


def _decide(layout: SetLayout, state: SlotState, ids: jax.Array, valid: jax.Array) -> _Decided:
    n, w = ids.shape[0], layout.ways
    total = layout.total_slots
    clock = state.clock + 1
    ok = valid & (ids >= 0) & (ids < layout.rows)
    row = jnp.where(ok, ids, 0)
    shard = row // layout.shard_rows
    local = row - shard * layout.shard_rows
    start, size = _set_of(layout, local, shard)
    way = jnp.arange(w, dtype=jnp.int32)
    inset = way[None, :] < size[:, None]  # [N, W]
    at = jnp.minimum(start[:, None] + way[None, :], total - 1)

    # lookup: hits stamped now (the batch's slots are no victims)
    hitw = (state.rows[at] == local[:, None]) & inset & ok[:, None]
    hit = hitw.any(axis=1)
    hit_slot = start + jnp.argmax(hitw, axis=1).astype(jnp.int32)
    hit_stamp = state.stamps[hit_slot]  # to put back if the batch is refused
    stamps = state.stamps.at[jnp.where(hit, hit_slot, total)].set(clock, mode="drop")

    # the misses: resolved in a branch sized for them (their work is per miss)
    miss = ok & ~hit
    n_miss = jnp.sum(miss, dtype=jnp.int32)
    at_miss = jnp.where(miss, jnp.cumsum(miss, dtype=jnp.int32) - 1, n)
    miss_at = jnp.full(n, n, jnp.int32).at[at_miss].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    sizes = sorted({max(1, n // 16), max(1, n // 4), max(n, 1)})
    branches = [
        functools.partial(_resolve, layout, state, stamps, clock, start, local, size, miss_at, k)
        for k in sizes
    ]
    pick = sum((n_miss > k).astype(jnp.int32) for k in sizes[:-1])
    r = jax.lax.switch(pick, branches) if len(sizes) > 1 else branches[0]()
    p_new = jnp.arange(n, dtype=jnp.int32) < r.n_new
    overflow = jnp.any(p_new & r.bad)
    v_slot = jnp.where(p_new, r.start + r.way, total)
    old = jnp.where(p_new, state.rows[jnp.minimum(v_slot, total - 1)], -1)
    fill_stamp = stamps[jnp.minimum(v_slot, total - 1)]
    stamps = stamps.at[v_slot].set(clock, mode="drop")
    hits_distinct = jnp.sum(stamps == clock, dtype=jnp.int32) - r.n_new
    miss_slot = jnp.where(miss, jnp.take(v_slot, jnp.clip(r.index, 0, n - 1)), 0)

    # every id as its slot
    slot = jnp.where(hit, hit_slot, miss_slot)
    slot = jnp.where(ok, slot, jnp.where(ids < 0, -1, total))
    slot = jnp.where(valid, slot, ids)

    # the moves, packed
    p_global = (r.start // layout.slots) * layout.shard_rows  # the shard's first row
    fill_slots = jnp.where(p_new, v_slot, -1)
    fill_rows = jnp.where(p_new, p_global + r.row, -1)
    ev = p_new & (old >= 0)
    ev_seen = jnp.cumsum(ev, dtype=jnp.int32)
    ev_at = jnp.where(ev, ev_seen - 1, n)
    evict_slots = jnp.full(n, -1, jnp.int32).at[ev_at].set(v_slot, mode="drop")
    evict_rows = jnp.full(n, -1, jnp.int32).at[ev_at].set(p_global + old, mode="drop")
    n_fill = r.n_new
    n_evict = ev_seen[-1] if n else jnp.int32(0)

    plan = SetPlan(
        state,
        slot,
        fill_slots,
        fill_rows,
        evict_slots,
        evict_rows,
        n_fill,
        n_evict,
        jnp.sum(ok, dtype=jnp.int32),
        hits_distinct + n_fill,
        overflow,
    )
    return _Decided(
        stamps, hit, hit_slot, hit_stamp, v_slot, fill_stamp, r.row, ok, row, clock, overflow, plan
    )


def _commit(layout: SetLayout, state: SlotState, d: _Decided, refused) -> SetPlan:
    """The decided plan kept, or (``d.overflow``, or ``refused``: another table's batch
    did not fit) refused. The state is updated in place (donated): a refused batch puts
    every stamp back (fills, then hits) and writes no row or count."""
    total = layout.total_slots
    undo = d.overflow if refused is None else d.overflow | refused
    stamps = d.stamps.at[jnp.where(undo, d.v_slot, total)].set(d.fill_stamp, mode="drop")
    stamps = stamps.at[jnp.where(undo & d.hit, d.hit_slot, total)].set(d.hit_stamp, mode="drop")
    rows = state.rows.at[jnp.where(undo, total, d.v_slot)].set(d.fill_row, mode="drop")
    counts = state.counts
    if layout.algorithm is CacheAlgorithm.LFU:  # every lookup counts, saturating
        counted = d.counted & ~undo
        at_row = jnp.where(counted, d.row, layout.rows)
        counts = counts.at[at_row].add(1, mode="drop")  # past int32's top it wraps below 0
        wrapped = counted & (counts[jnp.minimum(at_row, layout.rows - 1)] < 0)
        counts = counts.at[jnp.where(wrapped, d.row, layout.rows)].set(_MAX, mode="drop")
    clock = jnp.where(undo, state.clock, d.clock)
    return d.plan._replace(state=SlotState(rows, stamps, counts, clock))


class _Misses(NamedTuple):
    """The distinct missed rows of a batch packed at the front (``n_new`` of them, in
    (set, row) order), each's set and victim, and each id's distinct miss."""

    start: jax.Array  # int32 [N]: first slot of the set
    row: jax.Array  # int32 [N]: shard-local row
    way: jax.Array  # int32 [N]: the victim's way in the set
    bad: jax.Array  # bool [N]: no way left in the set (the batch overflows it)
    n_new: jax.Array  # int32 []
    index: jax.Array  # int32 [N]: for each missed id, its distinct miss


def _resolve(layout, state, stamps, clock, start, local, size, miss_at, k: int) -> _Misses:
    """The first ``k`` missed ids (``miss_at``: their positions, ``N`` past the last)
    resolved; every array padded to ``N``."""
    n, w = miss_at.shape[0], layout.ways
    total = layout.total_slots
    way = jnp.arange(w, dtype=jnp.int32)
    pos = miss_at[:k]
    live = pos < n
    pc = jnp.minimum(pos, n - 1)
    ss, sr, order = jax.lax.sort(
        (
            jnp.where(live, start[pc], _MAX),
            jnp.where(live, local[pc], 0),
            jnp.arange(k, dtype=jnp.int32),
        ),
        num_keys=2,
    )
    m = ss != _MAX
    prev_s, prev_r = jnp.roll(ss, 1).at[0].set(-1), jnp.roll(sr, 1).at[0].set(-1)
    new = m & ((ss != prev_s) | (sr != prev_r))
    seen = jnp.cumsum(new, dtype=jnp.int32)  # distinct misses so far (inclusive)
    set_first = m & (ss != prev_s)
    rank = seen - 1 - jax.lax.cummax(jnp.where(set_first, seen - 1, 0))
    at_new = jnp.where(new, seen - 1, k)

    def pack(x):
        return jnp.zeros(k, jnp.int32).at[at_new].set(x, mode="drop")

    p_start, p_row, p_rank = pack(jnp.where(m, ss, 0)), pack(sr), pack(rank)
    p_size = pack(jnp.take(size, jnp.take(pc, order)))

    # victims: the set's slots the batch does not use, in the policy's order
    vat = jnp.minimum(p_start[:, None] + way[None, :], total - 1)
    taken = (way[None, :] >= p_size[:, None]) | (stamps[vat] == clock)
    keys = [taken.astype(jnp.int32)]
    if layout.algorithm is CacheAlgorithm.LFU:
        held = state.rows[vat]
        owner = vat // layout.slots  # the shard of each slot
        cnt = state.counts[jnp.clip(owner * layout.shard_rows + held, 0, layout.rows - 1)]
        keys.append(jnp.where(held >= 0, cnt, -1))
    keys += [stamps[vat], jnp.broadcast_to(way, vat.shape)]
    ranked = jax.lax.sort(tuple(keys), dimension=1, num_keys=len(keys))
    choice = jnp.clip(p_rank, 0, w - 1)[:, None]
    v_way = jnp.take_along_axis(ranked[-1], choice, axis=1)[:, 0]
    bad = (jnp.take_along_axis(ranked[0], choice, axis=1)[:, 0] == 1) | (p_rank >= w)
    # each missed id's distinct miss, at its position in the batch
    index = (
        jnp.zeros(n, jnp.int32).at[jnp.where(m, jnp.take(pc, order), n)].set(seen - 1, mode="drop")
    )
    pad = (0, n - k)
    return _Misses(
        jnp.pad(p_start, pad),
        jnp.pad(p_row, pad),
        jnp.pad(v_way, pad),
        jnp.pad(bad, pad),
        seen[-1],
        index,
    )


def set_hash_np(x: np.ndarray) -> np.ndarray:
    """:func:`set_hash` in numpy."""
    x = np.asarray(x).astype(np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))


# ----- the C++ twin on CPU (jaxrec_cache_plan_sets) and the per-platform choice -----

CPU_TARGET = "jaxrec_cache_plan_sets"


def plan_sets_cpu(layout: SetLayout, state: SlotState, ids: jax.Array, valid: jax.Array) -> SetPlan:
    """:func:`plan_sets` as jaxrec's C++ CPU kernel ``jaxrec_cache_plan_sets``: the same
    outputs bit for bit (the state, the slots, the packed moves, the counts), the state
    updated in place (its buffers aliased to the new state's: donate it). Only for
    programs that run on the CPU platform with the kernels registered
    (``jaxrec.cpu.loader.has_target``; it loads them or raises ``RuntimeError``);
    :func:`plan` chooses. ``ids`` are taken as int32."""
    if not loader.has_target(CPU_TARGET):
        why = loader.unavailable_reason() or "an older build of jaxrec.cpu"
        raise RuntimeError(f"{CPU_TARGET} is not registered: {why}")
    n, total = ids.shape[0], layout.total_slots
    lfu = layout.algorithm is CacheAlgorithm.LFU
    want = (total, total, layout.rows if lfu else 0)
    got = (state.rows.shape, state.stamps.shape, state.counts.shape)
    if ids.ndim != 1 or valid.shape != ids.shape or got != tuple((k,) for k in want):
        raise ValueError(
            f"plan_sets_cpu: state shapes {got} (want {want}), ids {ids.shape}, valid {valid.shape}"
        )
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    outs = (
        i32(total),
        i32(total),
        i32(want[2]),
        i32(),
        *[i32(n)] * 5,
        *[i32()] * 4,
        jax.ShapeDtypeStruct((), jnp.bool_),
    )
    call = jax.ffi.ffi_call(CPU_TARGET, outs, input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3})
    res = call(
        state.rows.astype(jnp.int32),
        state.stamps.astype(jnp.int32),
        state.counts.astype(jnp.int32),
        state.clock.astype(jnp.int32),
        ids.astype(jnp.int32),
        valid.astype(jnp.bool_),
        rows=np.int64(layout.rows),
        shard_rows=np.int64(layout.shard_rows),
        shards=np.int64(layout.shards),
        slots=np.int64(layout.slots),
        sets=np.int64(layout.sets),
        lfu=np.int64(lfu),
    )
    return SetPlan(SlotState(*res[:4]), *res[4:])


def plan(
    layout: SetLayout, state: SlotState, ids: jax.Array, valid: jax.Array, implementation=None
) -> SetPlan:
    """:func:`plan_sets`, run by the C++ kernel (:func:`plan_sets_cpu`) where the program is
    lowered for CPU and the kernel is built, by :func:`plan_sets` elsewhere (chosen per
    lowering platform with ``jax.lax.platform_dependent``, as ``jaxrec.ops.dispatch``: a
    CPU host still compiles it for GPUs). ``implementation``: as in ``jaxrec.ops``
    (``None``, ``"cpu"`` or ``"mosaic_gpu"`` try the kernel, ``"xla"`` and ``"pallas"`` run
    :func:`plan_sets`). The same results either way; ``jax.jit`` it with ``layout``
    static and ``state`` donated."""
    if not _wants_kernel(implementation):
        return plan_sets(layout, state, ids, valid)

    def run(platform):
        fn = plan_sets_cpu if platform == "cpu" else plan_sets
        return fn(layout, state, ids, valid)

    return dispatch.by_platform(run, inputs=(state, ids, valid))


def plan_many(
    layouts: Sequence[SetLayout],
    states: Sequence[SlotState],
    ids: Sequence[jax.Array],
    valid: Sequence[jax.Array],
    implementation=None,
) -> list[SetPlan]:
    """:func:`plan` of several tables' ids, all kept or none (a table whose batch fits
    keeps its state when another's does not). XLA: :func:`plan_sets_many`, in place; the
    C++ kernel on CPU: each table planned in place, then every state selected whole when
    one is refused (a copy of the maps, in host memory)."""
    if len(layouts) == 1:
        return [plan(layouts[0], states[0], ids[0], valid[0], implementation)]
    if not _wants_kernel(implementation):
        return plan_sets_many(layouts, states, ids, valid)

    def run(platform):
        if platform != "cpu":
            return plan_sets_many(layouts, states, ids, valid)
        plans = [plan_sets_cpu(*x) for x in zip(layouts, states, ids, valid, strict=True)]
        refused = jnp.any(jnp.stack([p.overflow for p in plans]))
        return [
            p._replace(state=jax.tree.map(lambda a, b: jnp.where(refused, a, b), s, p.state))
            for s, p in zip(states, plans, strict=True)
        ]

    return dispatch.by_platform(run, inputs=(states, ids, valid))


def _wants_kernel(implementation) -> bool:
    """Whether ``implementation`` (checked: as in ``jaxrec.ops``) asks for the C++ plan on
    CPU and it is registered (saying once why not)."""
    if implementation not in dispatch.IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {dispatch.IMPLEMENTATIONS}, got {implementation!r}"
        )
    explicit = implementation == "cpu"
    wants = explicit or (implementation in (None, "mosaic_gpu") and dispatch.CPU_BY_DEFAULT)
    return wants and _kernel_ready(explicit)


def _kernel_ready(explicit: bool) -> bool:
    """Whether the C++ plan is registered (saying once why not)."""
    if loader.load() is not None:
        loader.warn_unavailable(explicit)
        return False
    if loader.has_target(CPU_TARGET):
        return True
    if not _STALE_WARNED:
        _STALE_WARNED.append(True)
        msg = (
            f"jaxrec's C++ extension has no {CPU_TARGET} (an older build): the slot map "
            "plans with XLA on CPU (the same plans, slower); rebuild it: pip install -e ."
        )
        if explicit:
            import warnings

            warnings.warn(msg, loader.CpuKernelWarning, stacklevel=4)
        else:
            loader.logger.warning(msg)
    return False


_STALE_WARNED: list = []
