"""Synthetic multi-hot expansion of one-hot Criteo (MLPerf DLRM-DCNv2's ``Multihot``).

MLPerf's DLRM-DCNv2 benchmark (TorchRec's ``examples/dlrm/data/multi_hot.py``)
turns each one-hot id ``x`` of table ``k`` into a fixed bag of
``multi_hot_sizes[k]`` ids: ``x`` itself followed by ``size - 1`` ids looked up
in a per-table table drawn once, ``uniform`` (``randint(0, E)``) or ``pareto``
(``pareto(a=0.25).astype(int32) % E``), from ``np.random.seed(0)``.

``method="table"`` reproduces those draws exactly (``RandomState(seed)``, tables
in order); it stores ``E x (size - 1)`` ids per table, so for big tables use
``method="hash"``: the same distributions from a counter-based hash of
``(seed, table, id, slot)``, nothing stored (different draws from MLPerf's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


class MultiHot:
    """Expands one-hot ids into fixed-size multi-hot bags.

    Args:
        multi_hot_sizes: bag size per table (>= 1; 1 leaves the feature one-hot).
        num_embeddings_per_feature: table sizes (ids must already be in range).
        dist_type: ``"uniform"`` or ``"pareto"``.
        seed: MLPerf uses 0.
        method: ``"table"`` (MLPerf's exact draws) or ``"hash"`` (no memory).
        max_table_bytes: ``method="table"`` refuses to build more than this.

    Example:
        >>> mh = MultiHot([3, 1], [100, 50])
        >>> mh.expand(0, np.array([7, 7, 9])).shape
        (3, 3)
    """

    def __init__(
        self,
        multi_hot_sizes: Sequence[int],
        num_embeddings_per_feature: Sequence[int],
        *,
        dist_type: str = "uniform",
        seed: int = 0,
        method: str = "table",
        max_table_bytes: int = 2**31,
    ):
        if dist_type not in ("uniform", "pareto"):
            raise ValueError(f"dist_type must be 'uniform' or 'pareto', got {dist_type!r}")
        if method not in ("table", "hash"):
            raise ValueError(f"method must be 'table' or 'hash', got {method!r}")
        if len(multi_hot_sizes) != len(num_embeddings_per_feature):
            raise ValueError(
                f"{len(multi_hot_sizes)} multi_hot_sizes for "
                f"{len(num_embeddings_per_feature)} tables"
            )
        if any(s < 1 for s in multi_hot_sizes):
            raise ValueError(f"multi_hot_sizes must be >= 1, got {list(multi_hot_sizes)}")
        self.multi_hot_sizes = [int(s) for s in multi_hot_sizes]
        self.num_embeddings_per_feature = [int(n) for n in num_embeddings_per_feature]
        self.dist_type, self.seed, self.method = dist_type, seed, method
        self.tables = None
        if method == "table":
            need = sum(
                n * (s - 1) * 8
                for n, s in zip(self.num_embeddings_per_feature, self.multi_hot_sizes, strict=True)
            )
            if need > max_table_bytes:
                raise ValueError(
                    f"method='table' would store {need / 2**30:.1f} GiB of lookup tables "
                    f"(max_table_bytes={max_table_bytes}); use method='hash'"
                )
            self.tables = self._make_tables()

    def _make_tables(self) -> list[np.ndarray]:
        rng = np.random.RandomState(self.seed)  # = MLPerf's np.random.seed(0) global stream
        tables = []
        for n, size in zip(self.num_embeddings_per_feature, self.multi_hot_sizes, strict=True):
            if self.dist_type == "uniform":
                extra = rng.randint(0, n, size=(n, size - 1))
            else:
                with np.errstate(invalid="ignore"):  # MLPerf casts huge draws to int32
                    extra = rng.pareto(a=0.25, size=(n, size - 1)).astype(np.int32) % n
            tables.append(np.concatenate([np.arange(n)[:, None], extra], 1).astype(np.int64))
        return tables

    def expand(self, k: int, ids: np.ndarray) -> np.ndarray:
        """Bags ``[len(ids), multi_hot_sizes[k]]`` int64 for one-hot ``ids`` of table ``k``."""
        ids = np.asarray(ids, np.int64)
        n, size = self.num_embeddings_per_feature[k], self.multi_hot_sizes[k]
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise ValueError(f"table {k}: ids must lie in [0, {n}), got {bad}; hash them first")
        if self.tables is not None:
            return self.tables[k][ids]
        slots = np.arange(1, size, dtype=np.uint64)
        u = _uniform(self.seed, k, ids.astype(np.uint64)[:, None], slots[None, :])
        if self.dist_type == "uniform":
            extra = np.minimum((u * n).astype(np.int64), n - 1)
        else:  # numpy's pareto is Lomax: (1 - u) ** (-1 / a) - 1
            draw = np.minimum((1.0 - u) ** -4.0 - 1.0, 2**31 - 1)
            extra = draw.astype(np.int64) % n
        return np.concatenate([ids[:, None], extra], 1)


_U = TypeVar("_U", np.ndarray, np.uint64)  # a scalar seed or an array of ids


def _splitmix(x: _U) -> _U:
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


def _uniform(seed: int, k: int, ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) doubles, a pure function of (seed, table, id, slot)."""
    x = _splitmix(np.uint64(seed) * np.uint64(1_000_003) + np.uint64(k))
    x = _splitmix(x ^ ids)
    x = _splitmix(x ^ slots)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53
