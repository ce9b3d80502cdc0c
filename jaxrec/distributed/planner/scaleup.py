"""Device memory a plan leaves free, spent on larger caches (TorchRec's
``EmbeddingOffloadScaleupProposer``).

A plan that caches tables keeps each cache at its ``CacheParams.load_factor``
even when the devices have memory to spare. :func:`scale_up_caches` spends it:
each cached table climbs a ladder of load factors (doubling, then the table
whole in device memory, ``fused``, where its constraints allow it), and the rung
taken next is the one that saves the most step time per device byte it adds,
as the cost model prices misses (``cache_statistics``: a table whose hot rows a
small cache already holds gains little); near-ties go to the smallest cache.
Every rung is placed by the partitioner; one that does not fit (or saves
nothing) is tried again halfway down, geometrically, until it is within 10% of
the last that did. TorchRec splits a
searched budget in proportion to each table's cacheability; this greedy uses the
miss-rate curve itself and the partitioner's exact packing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from ..types import EmbeddingComputeKernel
from .cost_model import CostModel
from .enumerator import estimate_option
from .options import ShardingOption
from .placement import Placement

LADDER = 2.0  # each rung's load factor over the last one's
PROMOTE_AT = 0.9  # past this load factor the next rung is the whole table (``fused``)
FINEST = 1.1  # a rung that did not fit is halved (geometrically) down to this ratio
NEAR_TIE = 0.9  # gains per byte this close to the best count as a tie


def _rung(option: ShardingOption, cost: CostModel, load_factor: float) -> ShardingOption:
    """``option``'s shards with a cache of ``load_factor``; at 1, the whole table in
    device memory (``fused``) where its constraints allow it, else a cache of every row."""
    if option.cache is None:
        raise ValueError(f"table {option.table.key!r}: only a cached option has a cache to scale")
    kernels = option.table.constraints.kernels(option.sharding_type)
    cache = None
    if load_factor < 1 or EmbeddingComputeKernel.FUSED not in kernels:
        cache = dataclasses.replace(option.cache, load_factor=min(1.0, load_factor))
    return estimate_option(
        option.table,
        cost,
        option.sharding_type,
        option.shards,
        option.placement,
        option.ranks,
        option.blocks,
        cache=cache,
    )


def _target(good: float, bad: float | None) -> float | None:
    """The next load factor to try above ``good`` (1: the whole table), below ``bad``
    (the lowest that did not fit); None: none is worth a try."""
    if bad is None:
        return good * LADDER if good * LADDER <= PROMOTE_AT else 1.0
    if bad / good <= FINEST:
        return None
    return math.floor((good * bad) ** 0.5 * 1e4) / 1e4  # 4 places: plans stay readable


def scale_up_caches(
    proposal: Sequence[ShardingOption],
    placed: Placement,
    cost: CostModel,
    partition: Callable[[Sequence[ShardingOption]], Placement],
    acceptable: Callable[[Placement], bool],
) -> tuple[list[ShardingOption], Placement]:
    """``proposal`` (placed as ``placed``) with its caches as large as the devices hold:
    greedily, the rung that saves the most seconds a step per device byte, kept when
    ``partition`` fits it, ``acceptable`` takes it and the step gets faster; a rung
    that is not kept is tried again halfway down (geometrically)."""
    proposal = list(proposal)
    # per cached table: (the largest load factor kept, the lowest that did not fit)
    bounds: dict[int, tuple[float, float | None]] = {
        i: (o.cache.load_factor, None) for i, o in enumerate(proposal) if o.cache
    }

    def next_rung(i: int) -> tuple[float, ShardingOption] | None:
        """(load factor, option), or None: none left, or it saves nothing."""
        lf = _target(*bounds[i]) if proposal[i].cache is not None else None
        if lf is None:
            return None
        rung = _rung(proposal[i], cost, lf)
        return None if rung.perf >= proposal[i].perf else (lf, rung)

    # the tables with a rung left; only the table just tried changes
    rungs = {i: r for i in bounds if (r := next_rung(i)) is not None}
    while rungs:
        gains = {
            i: (proposal[i].perf - r.perf) / max(r.total_bytes - proposal[i].total_bytes, 1.0)
            for i, (_, r) in rungs.items()
        }
        best = max(gains.values())
        # near-ties go to the smallest cache: nearly straight curves (uniform ids, or a
        # short sample's) would otherwise pile every byte on the first table to climb
        near = [i for i, g in gains.items() if g >= NEAR_TIE * best]
        i = min(near, key=lambda j: bounds[j][0])
        lf, rung = rungs[i]
        trial = [*proposal[:i], rung, *proposal[i + 1 :]]
        tried = partition(trial)
        if tried.feasible and acceptable(tried) and tried.perf.total < placed.perf.total:
            proposal, placed = trial, tried
            bounds[i] = (lf, bounds[i][1])
        else:
            bounds[i] = (bounds[i][0], lf)
        if (r := next_rung(i)) is None:
            del rungs[i]
        else:
            rungs[i] = r
    return proposal, placed
