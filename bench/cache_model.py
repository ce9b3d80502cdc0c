"""Hit rates of a cache under independent Zipf requests, from the law alone: the
references that ``bench/cache.py --policy-rows`` checks its simulated policies against.

- LRU: Che's approximation (Che, Tung and Wang, IEEE JSAC 20(7), 2002). Each row
  stays cached for a "characteristic time" T after its last use; T is fixed by the
  expected number of cached rows equalling the slot count. Accurate to a few 1e-3
  for Zipf laws at these sizes.
- The most frequent rows held (a static cache of the top ``slots`` rows): what LFU
  approaches once its counts have converged, and the most any policy that does not
  see the future gets.

Ranks past ``exact`` are grouped into log-spaced bins (their probabilities vary slowly
there), so 10^10 rows cost a few milliseconds.
"""

from __future__ import annotations

import numpy as np


def _ranks(rows: int, alpha: float, exact: int = 1_000_000, bins: int = 20_000):
    """``(p, count)``: the probability of one rank of each group and its rank count."""
    k = np.arange(1, min(rows, exact) + 1, dtype=np.float64)
    p, count = [k**-alpha], [np.ones_like(k)]
    if rows > exact:
        edges = np.unique(np.geomspace(exact + 0.5, rows + 0.5, bins))
        lo, hi = edges[:-1], edges[1:]
        if abs(alpha - 1.0) < 1e-12:
            mass = np.log(hi / lo)
        else:
            mass = (hi ** (1 - alpha) - lo ** (1 - alpha)) / (1 - alpha)
        p.append(mass / (hi - lo))
        count.append(hi - lo)
    p, count = np.concatenate(p), np.concatenate(count)
    return p / (p * count).sum(), count


def lru_hit_rate(rows: int, slots: int, alpha: float) -> float:
    """Che's approximation of LRU's hit rate (ids served from the cache)."""
    p, count = _ranks(rows, alpha)
    lo, hi = 1.0, 1e40
    for _ in range(300):  # bisection on log T
        t = np.sqrt(lo * hi)
        cached = (count * -np.expm1(-p * t)).sum()
        lo, hi = (t, hi) if cached < slots else (lo, t)
    return float((count * p * -np.expm1(-p * t)).sum())


def top_rows_hit_rate(rows: int, slots: int, alpha: float) -> float:
    """The hit rate of a cache that holds the ``slots`` most frequent rows."""
    p, count = _ranks(rows, alpha)  # in rank order: most frequent first
    full = np.cumsum(count) <= slots
    rest = slots - count[full].sum()
    partial = p[~full][:1] * min(rest, count[~full][:1].sum()) if (~full).any() else 0.0
    return float((count[full] * p[full]).sum() + np.sum(partial))
