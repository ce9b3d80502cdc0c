"""Per-row sums across column shards, so row-wise optimizers stay exact.

Row-wise Adagrad's accumulator, partial row-wise Adam's second moment and the
LAMB/LARS norms reduce over a whole row. A column shard holds a slice of it,
so (unlike TorchRec, which keeps one state per shard) each shard's partial
sums are added across the row's shards: every rank scatters its partials into
a vector over the logical rows of its column-split tables, one ``psum`` adds
them, and each rank reads its rows back. The cost is one all-reduce of
``4 * sum(num_embeddings)`` bytes of those tables per reduction (row-wise
Adagrad: one per step); element-wise optimizers never call it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..configs import BaseEmbeddingConfig
from .layout import ShardedLayout, WidthGroup


def column_split_row_sum(
    group: WidthGroup, layout: ShardedLayout, tables: Sequence[BaseEmbeddingConfig], axis
):
    """``reduce(rows) -> (row_sum, width)`` for a group's unique local rows, or ``None``.

    ``row_sum(partial [U]) -> [U]`` completes per-row sums across shards;
    ``width [U]`` is each row's full embedding dim. ``None`` when no table of
    the group is split by columns.
    """
    conf = {t.name: t for t in tables}
    split = sorted(
        {s[0] for r in group.shards for s in r if group.ncols < conf[s[0]].embedding_dim}
    )
    if not split:
        return None
    elsewhere = sorted(
        {s[0] for g in layout.groups if g is not group for r in g.shards for s in r} & set(split)
    )
    base, total = {}, 0
    for t in split:
        base[t], total = total, total + conf[t].num_embeddings
    k = max(len(r) for r in group.shards)
    offs = np.full((layout.world_size, k + 1), group.rows_per_rank, np.int32)
    space = np.full((layout.world_size, k + 1), -1, np.int32)
    width = np.full((layout.world_size, k + 1), group.ncols, np.int32)
    for rank, shards in enumerate(group.shards):
        for i, (t, r0, _, _, off) in enumerate(sorted(shards, key=lambda s: s[4])):
            offs[rank, i] = off
            if t in base:
                space[rank, i], width[rank, i] = base[t] + r0, conf[t].embedding_dim

    def reduce(rows):
        me = jax.lax.axis_index(axis)
        o, sp, wd = (jnp.asarray(x)[me] for x in (offs, space, width))
        j = jnp.clip(jnp.searchsorted(o, rows, side="right") - 1, 0, k)
        idx = jnp.where((rows < group.rows_per_rank) & (sp[j] >= 0), sp[j] + rows - o[j], total)

        def row_sum(partial):
            if elsewhere:
                raise NotImplementedError(
                    f"tables {elsewhere} are split into columns of different widths; a "
                    "row-wise optimizer needs equal column shards (a shard count that "
                    "divides the embedding dim)"
                )
            vec = jnp.zeros((total,), jnp.float32).at[idx].add(partial, mode="drop")
            vec = jax.lax.psum(vec, axis)
            return jnp.where(idx < total, vec.at[idx].get(mode="fill", fill_value=0), partial)

        return row_sum, wd[j]

    return reduce
