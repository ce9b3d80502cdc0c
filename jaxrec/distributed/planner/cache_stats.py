"""Expected miss rate of a device row cache (TorchRec's ``CacheStatistics``).

A ``fused_uvm_caching`` table keeps ``load_factor`` of its rows in device
memory; every id whose row is not cached costs a host-to-device copy. Without
statistics the planner assumes uniform ids (miss rate ``1 - load_factor``,
TorchRec's default too). Skewed ids miss less: :class:`ZipfCacheStatistics`
prices ids drawn from a Zipf law, :class:`MissRateCurve` a curve measured on
real ids (e.g. with ``bench/cache.py``). Give either as
``ParameterConstraints(cache_statistics=...)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

EXACT_TERMS = 1000  # harmonic sums: terms summed one by one before Euler-Maclaurin


class CacheStatistics:
    """Interface: the expected fraction of lookups that miss a cache of
    ``load_factor * rows`` rows (1.0 at load factor 0, 0.0 at 1)."""

    def expected_miss_rate(self, load_factor: float, rows: int) -> float:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class UniformCacheStatistics(CacheStatistics):
    """Every row equally likely: whatever the cache holds, it holds ``load_factor``
    of the lookups."""

    def expected_miss_rate(self, load_factor: float, rows: int) -> float:
        del rows
        return min(1.0, max(0.0, 1.0 - load_factor))


def generalized_harmonic(n: float, alpha: float) -> float:
    """``sum(i ** -alpha for i in 1..n)``: exact up to ``EXACT_TERMS``, then the
    Euler-Maclaurin tail (relative error below 1e-12 there)."""
    m = min(int(n), EXACT_TERMS)
    head = float(np.sum(np.arange(1, m + 1, dtype=np.float64) ** -alpha))
    if n <= m:
        return head
    if alpha == 1.0:
        integral = np.log(n / m)
    else:
        integral = (n ** (1 - alpha) - m ** (1 - alpha)) / (1 - alpha)
    ends = (n**-alpha - m**-alpha) / 2
    slopes = -alpha * (n ** (-alpha - 1) - m ** (-alpha - 1)) / 12
    return head + integral + ends + slopes


@dataclasses.dataclass(frozen=True)
class ZipfCacheStatistics(CacheStatistics):
    """Ids drawn independently with ``P(row of rank i) ~ i ** -alpha``.

    The miss rate is that of a cache holding the ``load_factor * rows`` most
    frequent rows, ``1 - H(k) / H(rows)`` with ``H`` the generalized harmonic
    sum: the limit an LFU cache reaches; LRU misses somewhat more. Row-wise
    shards of hashed ids see the same law, so a shard's rate equals the table's.

    Example:
        >>> ZipfCacheStatistics(alpha=1.05).expected_miss_rate(0.1, 10**8)  # about 0.1
    """

    alpha: float

    def __post_init__(self):
        if not self.alpha > 0:
            raise ValueError(f"ZipfCacheStatistics.alpha must be positive, got {self.alpha}")

    def expected_miss_rate(self, load_factor: float, rows: int) -> float:
        k = min(float(rows), max(0.0, load_factor * rows))
        if k < 1:
            return 1.0
        return max(
            0.0,
            1.0
            - generalized_harmonic(k, self.alpha) / generalized_harmonic(float(rows), self.alpha),
        )


@dataclasses.dataclass(frozen=True)
class MissRateCurve(CacheStatistics):
    """A measured miss-rate curve, interpolated linearly (``(0, 1)`` and ``(1, 0)``
    are implied unless given).

    Example:
        >>> MissRateCurve(load_factors=[0.05, 0.1, 0.2], miss_rates=[0.2, 0.1, 0.04])
    """

    load_factors: Sequence[float]
    miss_rates: Sequence[float]

    def __post_init__(self):
        lf, mr = tuple(map(float, self.load_factors)), tuple(map(float, self.miss_rates))
        if len(lf) != len(mr) or not lf:
            raise ValueError(
                f"MissRateCurve needs as many miss_rates as load_factors, got {len(lf)} and "
                f"{len(mr)}"
            )
        rising = all(a < b for a, b in zip(lf, lf[1:], strict=False))
        if any(not 0 <= x <= 1 for x in lf + mr) or not rising:
            raise ValueError(
                "MissRateCurve: load_factors must increase within [0, 1] and miss_rates lie "
                f"in [0, 1], got {lf} and {mr}"
            )
        object.__setattr__(self, "load_factors", lf)
        object.__setattr__(self, "miss_rates", mr)

    def expected_miss_rate(self, load_factor: float, rows: int) -> float:
        del rows
        xs, ys = list(self.load_factors), list(self.miss_rates)
        if xs[0] > 0:
            xs, ys = [0.0, *xs], [1.0, *ys]
        if xs[-1] < 1:
            xs, ys = [*xs, 1.0], [*ys, 0.0]
        return float(np.interp(load_factor, xs, ys))
