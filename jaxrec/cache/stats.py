"""A table's miss rates measured on its own ids: the planner's ``cache_statistics``.

Without statistics the planner prices a cached table as if its ids were uniform
(miss rate ``1 - load_factor``, TorchRec's default). :func:`measure_miss_rates`
runs this cache's own bookkeeping (``SlotMap``: the policy, no rows moved) over a
sample of the table's batches at several load factors and returns what it missed
as a :class:`~jaxrec.distributed.planner.MissRateCurve`.

The cache starts cold, so a sample much shorter than the cache takes to fill
measures its first steps, not its steady state: the rates are then too high
(pessimistic, never flattering). Only the last ``counted`` share of the batches
is counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..distributed.planner import MissRateCurve
from ..distributed.types import CacheAlgorithm, cache_slots
from .slots import CacheTooSmallError, SlotMap

LOAD_FACTORS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def measure_miss_rates(
    batches: Sequence[np.ndarray],
    rows: int,
    load_factors: Sequence[float] = LOAD_FACTORS,
    algorithm: CacheAlgorithm | str = CacheAlgorithm.LRU,
    counted: float = 0.5,
) -> MissRateCurve:
    """The share of looked-up ids whose row a cache of ``load_factor * rows`` slots had
    to fetch (a row missed twice in one batch is fetched once), at each load factor,
    over the last ``counted`` share of ``batches`` (each: one table's ids, in
    ``[0, rows)``). A load factor whose cache cannot hold one batch's distinct rows
    gets 1.0: such a cache cannot run at all (jaxrec's needs a batch's rows in slots).
    """
    if not batches:
        raise ValueError("measure_miss_rates needs at least one batch of ids")
    if not 0 < counted <= 1:
        raise ValueError(f"counted must lie in (0, 1], got {counted}")
    parts = [np.asarray(b, np.int32).ravel() for b in batches]
    bad = [i for i, p in enumerate(parts) if len(p) and (p.min() < 0 or p.max() >= rows)]
    if bad:
        raise ValueError(f"batches {bad[:5]} hold ids outside [0, {rows})")
    first = len(parts) - max(1, round(counted * len(parts)))
    rates = []
    for lf in load_factors:
        m = SlotMap(rows, cache_slots(rows, lf), CacheAlgorithm(algorithm))
        ids = fetched = 0
        try:
            for i, p in enumerate(parts):
                a = m.assign(m.plan([p], "measure_miss_rates"))
                m.touch(p, np.empty_like(p), 0)
                if i >= first:
                    ids, fetched = ids + len(p), fetched + len(a.fill_rows)
        except CacheTooSmallError:
            ids, fetched = 1, 1
        rates.append(fetched / ids if ids else 0.0)
    # a larger cache never misses more (LRU's inclusion; LFU all but always): keep the
    # curve monotone against sampling noise
    rates = np.minimum.accumulate(np.asarray(rates, np.float64))
    return MissRateCurve(load_factors=tuple(load_factors), miss_rates=tuple(map(float, rates)))
