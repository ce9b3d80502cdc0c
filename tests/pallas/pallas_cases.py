"""Ragged inputs shared by the Pallas kernel tests (small, fixed shapes: few compiles)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = {"fp32": jnp.float32, "fp16": jnp.float16, "bf16": jnp.bfloat16}
# Bag lengths covering the edge cases: empty bags (first, middle and last), a
# one-id bag, one huge bag, and the capacity boundary (the ids fill the buffer).
LENGTHS = (0, 1, 3, 0, 37, 2, 2, 0, 5, 1, 4, 0)
TABLE_ROWS = (24, 40)  # two stacked tables ("mixed tables"): rows [0, 24) and [24, 64)


def ragged_case(seed: int, *, dim: int, dtype: str, weighted: bool, padding: int = 0):
    """A table-batched pooled-lookup batch over two stacked tables.

    Bags alternate between the two tables; bag 5 repeats one id (duplicate
    ids), bag 8 uses a single id five times (all ids equal). ``padding``
    positions past the last bag carry garbage ids and belong to no bag.

    Returns:
        ``weights [64, dim]``, ``rows [C]``, ``starts [B]``, ``ends [B]``,
        ``scale [C]`` (per-sample weights or ones), ``segment_ids [C]`` (``B``
        for padding) and the bag lengths.
    """
    rng = np.random.default_rng(seed)
    num_rows = sum(TABLE_ROWS)
    weights = jnp.asarray(rng.normal(size=(num_rows, dim)), DTYPES[dtype])
    lengths = np.asarray(LENGTHS)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    ids = []
    for b, n in enumerate(lengths):
        table = b % 2
        lo = 0 if table == 0 else TABLE_ROWS[0]
        bag = rng.integers(0, TABLE_ROWS[table], n) + lo
        if b == 5:
            bag[:] = bag[0]
        if b == 8:
            bag[:] = lo + 3
        ids.append(bag)
    ids.append(rng.integers(0, num_rows, padding))
    rows = np.concatenate(ids).astype(np.int32)
    seg = np.concatenate([np.repeat(np.arange(len(lengths)), lengths), np.full(padding, 12)])
    scale = rng.random(rows.shape[0]).astype(np.float32) if weighted else np.ones(rows.shape[0])
    return (
        weights,
        jnp.asarray(rows),
        jnp.asarray(starts, jnp.int32),
        jnp.asarray(ends, jnp.int32),
        jnp.asarray(scale, jnp.float32),
        jnp.asarray(seg, jnp.int32),
        lengths,
    )


def pooled_tolerance(weights: jax.Array, scale: jax.Array, max_len: int) -> float:
    """float32 accumulation error bound: a few ulps of the largest term, times the bag length."""
    big = float(jnp.max(jnp.abs(weights.astype(jnp.float32)))) * float(jnp.max(jnp.abs(scale)))
    return 8 * 2.0**-23 * max(max_len, 1) * big


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"
