"""A table's miss rates measured on its own ids: the planner's ``cache_statistics``.

Without statistics the planner prices a cached table as if its ids were uniform
(miss rate ``1 - load_factor``, TorchRec's default). :func:`measure_miss_rates`
estimates a table's curve from a sample of its batches in two ways and keeps the
lower of the two at each load factor:

- **cold**: this cache's own bookkeeping (``SlotMap``: the policy, no rows moved)
  run over the sample from empty, the last ``counted`` share counted. Exact for
  caches the sample fills; a sample shorter than a large cache takes to fill
  measures only its first steps (every row the sample sees for the first time
  misses), so large load factors look no better than small ones;
- **steady**: the law the sample suggests, run to its steady state. Each row's
  share of the lookups is its count (Good-Turing-adjusted for rows seen up to 5
  times), the rows never seen share what the rows seen once suggest is left
  (``n1 / N``); then Che's approximation of LRU. LFU gets the same: its own
  limit (the sample's most frequent rows) overrates rows that the sample's noise
  put on top, and under independent draws LFU misses no more than LRU.

Both err high on the samples we tried (Zipf and uniform ids), so the lower is
the nearer (tests/cache/test_cache_stats.py: within 0.06 of the true LRU rates
at every load factor, never 0.01 below).
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
    steady: bool = True,
) -> MissRateCurve:
    """The share of looked-up ids whose row a cache of ``load_factor * rows`` slots
    fetches, at each load factor, from ``batches`` (each: one table's ids, in
    ``[0, rows)``): the lower of the cold run (a row missed twice in one batch is
    fetched once; the last ``counted`` share of the batches) and, with ``steady``, the
    steady-state estimate (see the module). A load factor whose cache cannot hold one
    batch's distinct rows gets 1.0: such a cache cannot run at all (jaxrec's needs a
    batch's rows in slots).
    """
    if not batches:
        raise ValueError("measure_miss_rates needs at least one batch of ids")
    if not 0 < counted <= 1:
        raise ValueError(f"counted must lie in (0, 1], got {counted}")
    parts = [np.asarray(b).ravel() for b in batches]
    bad = [i for i, p in enumerate(parts) if len(p) and (p.min() < 0 or p.max() >= rows)]
    if bad:
        raise ValueError(f"batches {bad[:5]} hold ids outside [0, {rows})")
    ids = np.int32 if rows <= np.iinfo(np.int32).max else np.int64  # int32: the C++ passes
    parts = [p.astype(ids, copy=False) for p in parts]
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
    rates = np.asarray(rates, np.float64)
    if steady:
        warm = _steady_miss_rates(np.concatenate(parts), rows, load_factors)
        rates = np.where(rates < 1.0, np.minimum(rates, warm), rates)  # 1.0: cannot run
    # a larger cache never misses more (LRU's inclusion; LFU all but always): keep the
    # curve monotone against sampling noise
    rates = np.minimum.accumulate(rates)
    return MissRateCurve(load_factors=tuple(load_factors), miss_rates=tuple(map(float, rates)))


def _steady_miss_rates(ids: np.ndarray, rows: int, load_factors) -> np.ndarray:
    """The steady-state LRU miss rates of the law the sample ``ids`` suggests (module)."""
    if not len(ids):
        return np.ones(len(load_factors))
    _, c = np.unique(ids, return_counts=True)
    n, seen = len(ids), len(c)
    freq = np.bincount(c)  # freq[r]: rows seen r times
    share = c.astype(np.float64)
    for r in range(1, min(6, len(freq) - 1)):  # Good-Turing: r* = (r + 1) n_{r+1} / n_r
        if freq[r] and freq[r + 1]:
            share[c == r] = (r + 1) * freq[r + 1] / freq[r]
    unseen = rows - seen
    left = min(1.0, freq[1] / n) if unseen and len(freq) > 1 else 0.0
    p = share / share.sum() * (1.0 - left)  # the seen rows' shares of the lookups
    q = left / unseen if unseen else 0.0  # each unseen row's
    out = [1.0 - _che_hit_rate(p, cache_slots(rows, lf), unseen, q) for lf in load_factors]
    return np.clip(np.asarray(out), 0.0, 1.0)


def _che_hit_rate(p: np.ndarray, slots: int, unseen: int, q: float) -> float:
    """Che's approximation of an LRU cache of ``slots`` rows: the characteristic time
    ``t`` at which the expected rows requested equal the slots, then each row hits with
    probability ``1 - exp(-p t)`` (``unseen`` more rows of share ``q`` each)."""

    def occupied(t):
        return float(-np.expm1(-p * t).sum() + unseen * -np.expm1(-q * t))

    if occupied(1e300) <= slots:  # every row fits
        return 1.0
    lo, hi = 0.0, 1.0
    while occupied(hi) < slots:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if occupied(mid) < slots else (lo, mid)
    t = (lo + hi) / 2
    return float((p * -np.expm1(-p * t)).sum() + unseen * q * -np.expm1(-q * t))
