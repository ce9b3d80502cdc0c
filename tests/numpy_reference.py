"""Independent numpy references for lookups, built from per-bag Python lists."""

from __future__ import annotations

import numpy as np


def random_bags(rng, batch, max_len, num_embeddings, empty_prob=0.2):
    """``batch`` bags of random ids; some bags empty."""
    bags = []
    for _ in range(batch):
        empty = max_len == 0 or rng.random() < empty_prob
        n = 0 if empty else int(rng.integers(1, max_len + 1))
        bags.append(rng.integers(0, num_embeddings, size=n).tolist())
    return bags


def pooled(table, bags, pooling="SUM", weights=None):
    """``[B, D]`` pooled rows, float64 accumulation."""
    out = np.zeros((len(bags), table.shape[1]))
    for b, ids in enumerate(bags):
        for j, i in enumerate(ids):
            out[b] += table[i].astype(np.float64) * (1.0 if weights is None else weights[b][j])
        if pooling == "MEAN" and ids:
            out[b] /= len(ids)
    return out


def packed(bags_by_key):
    """TorchRec's packed layout: key-major lengths and values."""
    lengths = [len(b) for bags in bags_by_key for b in bags]
    values = [i for bags in bags_by_key for b in bags for i in b]
    return np.asarray(values, np.int64), np.asarray(lengths, np.int64)


def rank_auc(labels, scores):
    """Rank-based (Mann-Whitney) AUC in float64, tied scores sharing their average rank:
    a formula independent of pairwise counting and of jaxrec.metrics' grouped maths."""
    order = np.argsort(scores, kind="stable")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return (ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
