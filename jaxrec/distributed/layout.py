"""Static layout of a sharded collection: which rank holds which rows and columns.

Every sharding type reduces to shards: a block ``[row0, row0 + nrows) x
[col0, col0 + ncols)`` of one table on one rank. On each rank, shards of the
same width and dtype are stacked in one local buffer (FBGEMM's TBE layout, per
rank); globally a width group is one ``[world * rows_per_rank, ncols]`` array
sharded over the mesh. Each (shard, feature) pair is a *slot*; the lookup of a
slot produces a partial pooled block that output_dist sends home and sums
into the feature's output columns. Data-parallel tables are replicated and
looked up locally.

A table split into column blocks of different widths (a dim that does not
divide evenly) keeps all its blocks in the widest block's group: narrower
blocks are zero-padded on the right (``WidthGroup.narrow``). So the peers of a
row (its column shards) share one buffer and one update, as row-wise
optimizers need (``row_sums.py``); padded columns stay zero (their gradient is
zero) and are never read into an output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from ..configs import BaseEmbeddingConfig, PoolingType, get_embedding_names_by_table
from .types import ParameterSharding, ShardingType, ShardMetadata


@dataclasses.dataclass(frozen=True)
class Slot:
    """One feature reading one shard, as laid out on the shard's rank."""

    key: str
    output: int  # index of the output embedding
    local_offset: int  # first row of the shard in the rank's stacked buffer
    row0: int  # first logical row of the shard
    nrows: int
    col0: int  # first column of the shard in the output embedding
    mean: bool
    table_rows: int  # logical rows of the table (its ids spread over them)
    ncols: int  # the shard's own columns (fewer than its group's when zero-padded)


class ShardSlice(NamedTuple):
    """One shard as stacked on its rank: logical rows ``[row0, row0 + nrows)`` and the
    columns from ``col0`` of ``table`` (``WidthGroup.width`` of them) at rows
    ``[local_offset, local_offset + nrows)`` of the rank's stacked buffer.

    TorchRec's ``ShardMetadata`` says ``shard_offsets = [row0, col0]``,
    ``shard_sizes = [nrows, width]``.
    """

    table: str
    row0: int
    nrows: int
    col0: int
    local_offset: int


class NarrowShard(NamedTuple):
    """A shard narrower than its width group: ``ncols`` columns from ``col0`` of
    ``table``'s rows from ``row0``, zero-padded up to the group's width."""

    table: str
    row0: int
    col0: int
    ncols: int


@dataclasses.dataclass(frozen=True)
class WidthGroup:
    """Shards of one ``(ncols, dtype)`` across ranks; ``slots[rank]`` in stacking order."""

    name: str
    ncols: int
    dtype: str
    rows_per_rank: int  # padded: the largest rank's total rows (at least 1)
    slots: tuple[tuple[Slot, ...], ...]
    shards: tuple[tuple[ShardSlice, ...], ...]  # per rank, in stacking order
    # the shards narrower than ``ncols`` (zero-padded), sorted
    narrow: tuple[NarrowShard, ...] = ()

    def width(self, table: str, row0: int, col0: int) -> int:
        """Columns of ``table``'s shard at ``(row0, col0)``: ``ncols`` unless padded."""
        return next(
            (s.ncols for s in self.narrow if (s.table, s.row0, s.col0) == (table, row0, col0)),
            self.ncols,
        )

    @property
    def tables(self) -> tuple[str, ...]:
        """The tables with shards in this group, rank by rank in stacking order."""
        return tuple(dict.fromkeys(s.table for r in self.shards for s in r))

    @property
    def max_slots(self) -> int:
        return max(1, max(len(s) for s in self.slots))


@dataclasses.dataclass(frozen=True)
class BufferKey:
    """One weight buffer of a sharded collection: a width group's (sharded over the mesh)
    or, ``replicated``, a group of data-parallel tables' (whole on every device).

    ``name`` is the serialised form: the buffer's key in ``weights`` (so in state
    paths), in the sparse optimizer state (``state_key``) and in row resets. It is
    the group's name, ``"dp_"``-prefixed when replicated, the form states have
    always been saved under (width groups are named ``<dtype>_c<ncols>``, so the
    two never collide).
    """

    group: str
    replicated: bool = False

    @property
    def name(self) -> str:
        return _REPLICATED_PREFIX + self.group if self.replicated else self.group


_REPLICATED_PREFIX = "dp_"


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
    world_size: int
    groups: tuple[WidthGroup, ...]
    replicated: tuple[str, ...]  # data-parallel tables
    embedding_names: tuple[str, ...]
    dims: tuple[int, ...]  # per output embedding


def build_layout(
    tables: Sequence[BaseEmbeddingConfig],
    plan: Mapping[str, ParameterSharding],
    world_size: int,
) -> ShardedLayout:
    missing = sorted({t.name for t in tables} - set(plan))
    if missing:
        raise ValueError(f"the plan has no sharding for tables {missing}")
    names = get_embedding_names_by_table(tables)
    first_output = np.cumsum([0] + [t.num_features() for t in tables]).tolist()
    per_group: dict[tuple[int, str], list[list]] = {}
    replicated = []
    for i, t in enumerate(tables):
        p = plan[t.name]
        if p.sharding_type is ShardingType.DATA_PARALLEL:
            replicated.append(t.name)
            continue
        if not p.sharding_spec:
            raise ValueError(f"table {t.name!r}: {p.sharding_type.value} sharding needs shards")
        _check_cover(t, p.sharding_spec)
        wide = max((s.shard_sizes[1] for s in p.sharding_spec if s.shard_sizes[0]), default=0)
        for s in p.sharding_spec:
            (r0, c0), (nr, nc) = s.shard_offsets, s.shard_sizes
            if nr == 0 or nc == 0:
                continue  # an empty trailing block
            if not 0 <= s.placement < world_size:
                raise ValueError(
                    f"table {t.name!r}: shard on rank {s.placement}, world is {world_size}"
                )
            ranks = per_group.setdefault((wide, t.data_type.value), [[] for _ in range(world_size)])
            mean = getattr(t, "pooling", PoolingType.SUM) is PoolingType.MEAN
            ranks[s.placement].append((t, i, r0, nr, c0, nc, mean))
    groups = []
    for (nc, dtype), ranks in per_group.items():
        slots, shards, rows = [], [], []
        narrow: list[NarrowShard] = []
        for entries in ranks:
            off, rank_slots, rank_shards = 0, [], []
            for t, i, r0, nr, c0, w, mean in entries:
                rank_shards.append(ShardSlice(t.name, r0, nr, c0, off))
                if w < nc:
                    narrow.append(NarrowShard(t.name, r0, c0, w))
                for j, f in enumerate(t.feature_names):
                    rank_slots.append(
                        Slot(f, first_output[i] + j, off, r0, nr, c0, mean, t.num_embeddings, w)
                    )
                off += nr
            slots.append(tuple(rank_slots))
            shards.append(tuple(rank_shards))
            rows.append(off)
        groups.append(
            WidthGroup(
                f"{dtype.lower()}_c{nc}",
                nc,
                dtype,
                max(1, max(rows)),
                tuple(slots),
                tuple(shards),
                tuple(sorted(narrow)),
            )
        )
    return ShardedLayout(
        world_size,
        tuple(groups),
        tuple(replicated),
        tuple(n for ns in names for n in ns),
        tuple(t.embedding_dim for t in tables for _ in t.feature_names),
    )


def _check_cover(t: BaseEmbeddingConfig, shards: Sequence[ShardMetadata]) -> None:
    """Shards must tile the table exactly: inside it, no overlap, full area."""
    boxes = []
    for s in shards:
        (r0, c0), (nr, nc) = s.shard_offsets, s.shard_sizes
        if r0 < 0 or c0 < 0 or r0 + nr > t.num_embeddings or c0 + nc > t.embedding_dim:
            raise ValueError(
                f"table {t.name!r}: shard {s} lies outside [{t.num_embeddings}, {t.embedding_dim}]"
            )
        boxes.append((r0, r0 + nr, c0, c0 + nc))
    overlap = any(
        a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
        if a[0] < a[1] and a[2] < a[3] and b[0] < b[1] and b[2] < b[3]
    )
    area = sum((b[1] - b[0]) * (b[3] - b[2]) for b in boxes)
    if overlap or area != t.num_embeddings * t.embedding_dim:
        raise ValueError(
            f"table {t.name!r}: the shards of its plan do not tile the table exactly once"
        )
