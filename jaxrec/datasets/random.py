"""Random recommendation data with a planted model (TorchRec's ``RandomRecDataset`` role).

TorchRec's ``torchrec.datasets.random.RandomRecDataset`` draws uniform ids and
coin-flip labels. jaxrec's draws ids from a power law (Zipf, ``alpha``) and
labels from a hidden logistic model, so a model trained on it has something
to learn and a known ceiling: ``oracle_logits`` are the true logits and
``reference_metrics()`` their AUC.

The planted logit of a sample::

    intercept + sum_k bias_k[bag_k] + dense @ w + sum_(a, b) <latent_a[bag_a], latent_b[bag_b]>

where ``x[bag]`` is the mean over the bag's ids (0 for an empty bag) and the
pairs ``(a, b)`` are consecutive keys ``(0, 1), (2, 3), ...`` (``interactions``
of them). Everything is deterministic from ``manual_seed`` (data) and
``model_seed`` (the planted model, default ``manual_seed``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .batching import Ragged, Table, TableDataset


@dataclasses.dataclass(frozen=True, eq=False)
class PlantedModel:
    """The hidden model: per-id biases and latent vectors, dense weights, intercept."""

    bias: tuple[np.ndarray, ...]  # per key: [num_embeddings]
    latent: dict  # key index -> [num_embeddings, latent_dim]
    pairs: tuple[tuple[int, int], ...]
    dense_weight: np.ndarray  # [num_dense]
    intercept: float

    @staticmethod
    def create(
        hash_sizes: Sequence[int],
        num_dense: int,
        *,
        seed: int = 0,
        interactions: int = 3,
        latent_dim: int = 4,
        bias_scale: float = 0.5,
        dense_scale: float = 0.4,
        latent_scale: float = 0.7,
        intercept: float = -1.0,
    ) -> PlantedModel:
        rng = np.random.default_rng([seed, 0])
        bias = tuple(rng.normal(0, bias_scale, n) for n in hash_sizes)
        pairs = tuple((2 * i, 2 * i + 1) for i in range(min(interactions, len(hash_sizes) // 2)))
        used = sorted({k for p in pairs for k in p})
        latent = {k: rng.normal(0, latent_scale, (hash_sizes[k], latent_dim)) for k in used}
        dense_weight = rng.normal(0, dense_scale, num_dense)
        return PlantedModel(bias, latent, pairs, dense_weight, float(intercept))

    def logits(self, dense: np.ndarray, columns: Sequence[Ragged]) -> np.ndarray:
        """True logits ``[N]`` of ``dense [N, D]`` and one :class:`Ragged` column per key."""
        out = self.intercept + np.asarray(dense, np.float64) @ self.dense_weight
        for k, col in enumerate(columns):
            out = out + _bag_mean(col, self.bias[k][:, None])[:, 0]
        for a, b in self.pairs:
            la = _bag_mean(columns[a], self.latent[a])
            lb = _bag_mean(columns[b], self.latent[b])
            out = out + np.sum(la * lb, axis=1)
        return out


def _bag_mean(col: Ragged, table: np.ndarray) -> np.ndarray:
    """Mean of ``table`` rows over each bag (0 for an empty bag): ``[N, table.shape[1]]``."""
    n = len(col)
    lengths = np.diff(col.offsets)
    owner = np.repeat(np.arange(n), lengths)
    sums = np.zeros((n, table.shape[1]))
    np.add.at(sums, owner, table[col.values])
    return sums / np.maximum(lengths, 1)[:, None]


def zipf_ids(rng: np.random.Generator, n: int, size: int, alpha: float | None) -> np.ndarray:
    """``size`` ids in ``[0, n)``; ``P(k) ~ (k + 1) ** -alpha`` (uniform when ``alpha`` is None).

    Id 0 is the most frequent. Unlike ``rng.zipf`` the support is bounded, and
    any ``alpha >= 0`` works (FBGEMM's benchmarks use ``alpha`` in ``[0, 2]``).
    Up to 2^22 ids it inverts the exact cdf; beyond, where that table would take
    ``8 n`` bytes (8 GB at 10^9 rows), it samples the same law by rejection
    (:func:`zipf_ranks`).
    """
    if alpha is None or alpha == 0:
        return rng.integers(0, n, size)
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0 (or None for uniform ids), got {alpha}")
    if n > _CDF_MAX:
        return zipf_ranks(rng, n, size, alpha) - 1
    cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -alpha)
    return np.minimum(np.searchsorted(cdf, rng.random(size) * cdf[-1], side="right"), n - 1)


_CDF_MAX = 1 << 22


def zipf_ranks(rng: np.random.Generator, n: int, size: int, alpha: float) -> np.ndarray:
    """``size`` ranks in ``[1, n]`` with ``P(k) ~ k ** -alpha`` exactly, in O(1) memory per
    rank: Hoermann and Derflinger's rejection-inversion (ACM TOMACS 6(3), 1996). A
    rank is the rounded inverse of the integral of ``x ** -alpha`` at a uniform point,
    kept when it falls under the step of the discrete law; most are kept (the first
    try keeps > 90% for ``alpha`` in [0.5, 2])."""
    s = float(alpha)

    def big_h(x):  # the integral of t ** -s from 1 to x, stable at s = 1
        lx = np.log(x)
        return lx * _expm1_over((1.0 - s) * lx)

    def big_h_inv(y):
        return np.exp(y * _log1p_over((1.0 - s) * y))

    def h(x):
        return np.exp(-s * np.log(x))

    lo, hi = big_h(1.5) - 1.0, big_h(n + 0.5)
    squeeze = 2.0 - big_h_inv(big_h(2.5) - h(2.0))  # ranks this close are always kept
    out = np.empty(size, np.int64)
    todo = np.arange(size)
    while len(todo):
        u = hi + rng.random(len(todo)) * (lo - hi)
        x = big_h_inv(u)
        k = np.clip(np.floor(x + 0.5), 1, n)
        keep = (k - x <= squeeze) | (u >= big_h(k + 0.5) - h(k))
        out[todo[keep]] = k[keep]
        todo = todo[~keep]
    return out


def _expm1_over(t):
    t = np.asarray(t, np.float64)
    small = np.abs(t) < 1e-8
    return np.where(small, 1.0 + t / 2, np.expm1(t) / np.where(small, 1.0, t))


def _log1p_over(t):
    t = np.asarray(t, np.float64)
    small = np.abs(t) < 1e-8
    return np.where(small, 1.0 - t / 2, np.log1p(t) / np.where(small, 1.0, t))


class RandomRecDataset(TableDataset):
    """``num_samples`` random samples with power-law ids and planted-model labels.

    Argument names follow TorchRec's ``RandomRecDataset`` (``hash_size(s)``,
    ``ids_per_feature(s)``, ``min_ids_per_feature(s)``, ``num_dense``,
    ``manual_seed``); as there, ``min_ids_per_feature`` defaults to
    ``ids_per_feature`` (fixed bags) when only the latter is given, and to 0
    otherwise. TorchRec's ``batch_size`` / ``num_batches`` live in
    :meth:`batches`.

    Args:
        keys: sparse feature names.
        num_samples: number of rows.
        alpha: Zipf exponent of the ids (None: uniform).
        model_seed: seed of the planted model (default ``manual_seed``); two
            datasets with one ``model_seed`` and different ``data_stream`` are a
            train/test pair.
        interactions, latent_dim, bias_scale, dense_scale, latent_scale, intercept:
            the planted model (see the module docstring).

    Example:
        >>> data = RandomRecDataset(["a", "b"], 1000, hash_sizes=[50, 80], ids_per_features=[1, 3],
        ...                         min_ids_per_features=[1, 0], num_dense=4, alpha=1.1)
        >>> batch = next(data.batches(128))
    """

    def __init__(
        self,
        keys: Sequence[str],
        num_samples: int,
        *,
        hash_size: int | None = None,
        hash_sizes: Sequence[int] | None = None,
        ids_per_feature: int | None = None,
        ids_per_features: Sequence[int] | None = None,
        min_ids_per_feature: int | None = None,
        min_ids_per_features: Sequence[int] | None = None,
        num_dense: int = 50,
        alpha: float | None = None,
        manual_seed: int = 0,
        model_seed: int | None = None,
        data_stream: int = 0,
        interactions: int = 3,
        latent_dim: int = 4,
        bias_scale: float = 0.5,
        dense_scale: float = 0.4,
        latent_scale: float = 0.7,
        intercept: float = -1.0,
    ):
        keys = list(keys)
        f = len(keys)
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        floats = dict(
            alpha=0.0 if alpha is None else alpha,
            bias_scale=bias_scale,
            dense_scale=dense_scale,
            latent_scale=latent_scale,
            intercept=intercept,
        )
        for name, value in floats.items():
            if not np.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
        hash_sizes = list(hash_sizes) if hash_sizes is not None else [hash_size or 100] * f
        if ids_per_features is None:
            ids_per_features = [ids_per_feature or 2] * f
        if min_ids_per_features is None:
            m = min_ids_per_feature if min_ids_per_feature is not None else ids_per_feature
            min_ids_per_features = [m or 0] * f
        for name, seq in [
            ("hash_sizes", hash_sizes),
            ("ids_per_features", ids_per_features),
            ("min_ids_per_features", min_ids_per_features),
        ]:
            if len(seq) != f:
                raise ValueError(f"{name} has {len(seq)} entries for {f} keys")
        bounds = zip(keys, min_ids_per_features, ids_per_features, hash_sizes, strict=True)
        for k, lo, hi, n in bounds:
            if not 0 <= lo <= hi or hi < 1 or n < 1:
                raise ValueError(
                    f"feature {k!r}: need 0 <= min ids <= max ids, max >= 1 and hash size >= 1; "
                    f"got min {lo}, max {hi}, hash size {n}"
                )
        self.model = PlantedModel.create(
            hash_sizes,
            num_dense,
            seed=manual_seed if model_seed is None else model_seed,
            interactions=interactions,
            latent_dim=latent_dim,
            bias_scale=bias_scale,
            dense_scale=dense_scale,
            latent_scale=latent_scale,
            intercept=intercept,
        )
        rng = np.random.default_rng([manual_seed, 1, data_stream])
        cols = []
        for n, lo, hi in zip(hash_sizes, min_ids_per_features, ids_per_features, strict=True):
            lengths = rng.integers(lo, hi + 1, num_samples)
            cols.append(Ragged.from_lengths(zipf_ids(rng, n, int(lengths.sum()), alpha), lengths))
        dense = rng.standard_normal((num_samples, num_dense)).astype(np.float32)
        logits = self.model.logits(dense, cols)
        labels = (rng.random(num_samples) < 1 / (1 + np.exp(-logits))).astype(np.float32)
        # single-valued features become plain [N] columns (capacity = batch size)
        sparse = [
            c.values if lo == hi == 1 else c
            for c, lo, hi in zip(cols, min_ids_per_features, ids_per_features, strict=True)
        ]
        super().__init__(
            Table(dense, sparse, labels),
            keys=keys,
            num_embeddings_per_feature=hash_sizes,
            max_ids_per_sample=dict(zip(keys, ids_per_features, strict=True)),
            oracle_logits=logits,
        )


def random_rec_split(
    num_train: int, num_eval: int, *, seed: int = 0, **kwargs
) -> tuple[RandomRecDataset, RandomRecDataset]:
    """A train and an eval :class:`RandomRecDataset` sharing one planted model.

    ``kwargs`` go to :class:`RandomRecDataset` (``keys`` is required).
    """
    train = RandomRecDataset(num_samples=num_train, manual_seed=seed, data_stream=0, **kwargs)
    test = RandomRecDataset(num_samples=num_eval, manual_seed=seed, data_stream=1, **kwargs)
    return train, test
