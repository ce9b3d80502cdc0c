"""A sharded collection's tables drawn where they live: each device draws only its shards.

A width group is one ``[world * rows_per_rank, ncols]`` array sharded over the mesh
(``layout.py``); device ``r`` holds rows ``[r * rows_per_rank, (r + 1) *
rows_per_rank)``, its shards stacked. One ``shard_map`` program per group has each
device draw its own block from the collection's key (``jaxrec.ops.init``: the
values a table has at ``(row, col)`` do not depend on where they are drawn), so no
device, and no host, ever holds more than its own shards. Data-parallel tables are
replicated: every device draws them whole (they are its shard).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..configs import BaseEmbeddingConfig
from ..embedding.tables import TableGroup
from ..ops.init import TablePiece, draw_rows, host_pieces, uniform_rows
from ..xla.philox import key_words
from .layout import WidthGroup


def check_drawable(configs: Sequence[BaseEmbeddingConfig]) -> None:
    """Tables with an ``init_fn`` cannot be drawn by shard: it draws whole tables."""
    custom = [t.name for t in configs if t.init_fn is not None]
    if custom:
        raise ValueError(
            f"tables {custom} have an init_fn, which draws a whole table: a sharded build "
            "from a model constructor draws only TorchRec's default uniform init shard by "
            "shard. Build the model eagerly and pass the module, or drop init_fn and set "
            "weight_init_min / weight_init_max"
        )


class GroupDraw(NamedTuple):
    """What one width group's draw compiles for: each device's ``[rows, cols]`` block of
    ``dtype``; ``aligned``: every piece starts on a multiple of 4 columns."""

    rows: int
    cols: int
    dtype: np.dtype
    aligned: bool


def group_pieces(
    group: WidthGroup,
    configs: Mapping[str, BaseEmbeddingConfig],
    streams: Mapping[str, int],
) -> tuple[GroupDraw, np.ndarray, np.ndarray]:
    """``(GroupDraw, ints int32[N, P, 6], floats float32[N, P, 2])``: each rank's pieces
    (``jaxrec.ops.init``) of ``group``. ``streams``: each table's index in its collection."""
    per_rank = [
        [
            TablePiece(
                s.local_offset,
                s.nrows,
                streams[s.table],
                s.row0,
                s.col0,
                group.width(s.table, s.row0, s.col0),
                configs[s.table].get_weight_init_min(),
                configs[s.table].get_weight_init_max(),
            )
            for s in shards
        ]
        for shards in group.shards
    ]
    ints, floats = host_pieces(per_rank, group.rows_per_rank)
    dtype = jnp.dtype(configs[group.tables[0]].dtype)
    aligned = bool((ints[..., 4] % 4 == 0).all())
    return GroupDraw(group.rows_per_rank, group.ncols, dtype, aligned), ints, floats


def draw_groups(
    groups: Sequence[WidthGroup],
    configs: Mapping[str, BaseEmbeddingConfig],
    streams: Mapping[str, int],
    mesh: jax.sharding.Mesh,
    key: jax.Array,
) -> list[jax.Array]:
    """Each group's ``[world * rows_per_rank, ncols]`` buffer, every device drawing its own
    block, all groups in one program (one compile)."""
    if not groups:
        return []
    draws, ints, floats = zip(*(group_pieces(g, configs, streams) for g in groups), strict=True)
    return list(groups_program(mesh, draws)(key_words(key), ints, floats))


@functools.lru_cache(maxsize=64)
def groups_program(mesh: jax.sharding.Mesh, draws: tuple[GroupDraw, ...]):
    """The jitted program drawing width groups: ``(key words uint32[2], (ints int32[N, P, 6],
    ...), (floats float32[N, P, 2], ...)) -> ([N * rows, cols], ...)`` sharded over the
    mesh, device ``r`` drawing rows ``[r * rows, (r + 1) * rows)`` of each group from its
    own pieces ``ints[r]``."""
    axis = tuple(mesh.axis_names)

    def local(words, ints, floats):
        rank = jax.lax.axis_index(axis)
        return tuple(
            draw_rows(
                words, i[rank], f[rank], rows=g.rows, cols=g.cols, dtype=g.dtype, aligned=g.aligned
            )
            for g, i, f in zip(draws, ints, floats, strict=True)
        )

    body = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(axis))
    return jax.jit(body, out_shardings=NamedSharding(mesh, P(axis)))


def draw_replicated(
    group: TableGroup,
    configs: Mapping[str, BaseEmbeddingConfig],
    streams: Mapping[str, int],
    mesh: jax.sharding.Mesh,
    key: jax.Array,
) -> jax.Array:
    """A data-parallel group's stacked tables, drawn whole on every device."""
    pieces = [
        TablePiece(
            off,
            configs[t].num_embeddings,
            streams[t],
            0,
            0,
            group.embedding_dim,
            configs[t].get_weight_init_min(),
            configs[t].get_weight_init_max(),
        )
        for t, off in zip(group.tables, group.row_offsets, strict=True)
    ]
    dtype = configs[group.tables[0]].dtype
    draw = jax.jit(
        lambda k: uniform_rows(k, pieces, group.num_rows, group.embedding_dim, dtype),
        out_shardings=NamedSharding(mesh, P()),
    )
    return draw(key_words(key))
