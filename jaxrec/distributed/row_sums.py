"""Per-row sums across column shards, so row-wise optimizers stay exact.

Row-wise Adagrad's accumulator, partial row-wise Adam's second moment and the
LAMB/LARS norms reduce over a whole row. A column shard holds a slice of it,
so (unlike TorchRec, which keeps one state per shard) each shard's partial
sums are added across the row's shards, its *peers* (the shards of the same
table holding the same rows in other columns).

Peers receive the same ids (every id of the table's features in their row
range), so in a step, or in one pass of the overflow path (``exact_update``),
they update the same rows. Each shard numbers its unique rows of the table in
ascending order (a row's *ordinal*, equal on every peer) and sends its peers
one float32 partial per ordinal: ``V_t = min(K, N * sum of the table's
feature capacities)`` values per table, bounded by the ids received, never by
the table's rows. The sends follow a static schedule of ``ppermute`` rounds
(each a partial permutation of the ranks; a pair of ranks that shares several
tables sends them in one buffer). Per-rank tables of offsets index everything
by ``axis_index``, so one program serves every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..configs import BaseEmbeddingConfig
from .layout import ShardedLayout, WidthGroup


@dataclasses.dataclass(frozen=True)
class PeerSchedule:
    """Static tables of one group's row-sum exchange (numpy, ``[N, ...]`` per rank)."""

    offsets: np.ndarray  # [N, k + 1] local offset of each shard (sorted), then rows_per_rank
    base: np.ndarray  # [N, k + 1] first vector slot of a split shard's rows, -1 otherwise
    size: np.ndarray  # [N, k + 1] V_t of a split shard, 0 otherwise
    width: np.ndarray  # [N, k + 1] full embedding dim of a split shard, ncols otherwise
    total: int  # vector length (the largest rank's sum of V_t)
    rounds: tuple[tuple[tuple[tuple[int, int], ...], np.ndarray, np.ndarray], ...]
    # per round: (perm [(src, dst)], send index [N, L], receive index [N, L]; fill = total)

    def bytes_sent(self) -> int:
        """Float32 bytes the busiest rank sends per row sum."""
        per_rank = np.zeros(self.offsets.shape[0], np.int64)
        for perm, send, _ in self.rounds:
            for a, _b in perm:
                per_rank[a] += 4 * send.shape[1]
        return int(per_rank.max(initial=0))


def peer_schedule(
    group: WidthGroup,
    layout: ShardedLayout,
    tables: Sequence[BaseEmbeddingConfig],
    sizes: Mapping[str, int],
) -> PeerSchedule | None:
    """The schedule for ``group``, or ``None`` when no table of it is split by columns.

    ``sizes[t]`` is ``V_t`` (see the module docstring). A table's column shards
    all sit in one group (narrower ones zero-padded, see ``layout.py``). Raises
    ``NotImplementedError`` for splits it cannot pair (column blocks that split
    rows differently, or two column shards of one table on one rank).
    """
    conf = {t.name: t for t in tables}
    n = layout.world_size
    split = sorted({t for t in group.tables if group.ncols < conf[t].embedding_dim})
    if not split:
        return None
    k = max(len(r) for r in group.shards)
    offsets = np.full((n, k + 1), group.rows_per_rank, np.int32)
    base = np.full((n, k + 1), -1, np.int32)
    size = np.zeros((n, k + 1), np.int32)
    width = np.full((n, k + 1), group.ncols, np.int32)
    where: dict[tuple[str, int, int], list[tuple[int, int, int]]] = {}  # (t, row0, nrows) ->
    for rank, shards in enumerate(group.shards):
        used = 0
        for i, s in enumerate(sorted(shards, key=lambda s: s.local_offset)):
            offsets[rank, i] = s.local_offset
            if s.table in split:
                base[rank, i], size[rank, i] = used, sizes[s.table]
                width[rank, i] = conf[s.table].embedding_dim
                where.setdefault((s.table, s.row0, s.nrows), []).append((rank, s.col0, used))
                used += sizes[s.table]
    _check_peers(where)
    edges: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (src, dst) -> slots
    for (t, _, _), shards in where.items():
        for a, _, base_a in shards:
            for b, _, base_b in shards:
                if a != b:
                    edges.setdefault((a, b), []).append((base_a, base_b, sizes[t]))
    total = max(1, int(np.max(np.where(base >= 0, base + size, 0))))
    return PeerSchedule(offsets, base, size, width, total, _rounds(edges, n, total))


def _check_peers(where) -> None:
    by_table: dict[str, list] = {}
    for (t, r0, nr), shards in where.items():
        ranks = [r for r, _, _ in shards]
        if len(set(ranks)) != len(ranks):
            raise NotImplementedError(
                f"table {t!r} has two column shards on one rank; a row-wise optimizer needs "
                "each column shard of a row range on its own rank"
            )
        by_table.setdefault(t, []).append((r0, nr, len(shards)))
    for t, ranges in by_table.items():
        counts = {c for _, _, c in ranges}
        spans = sorted((r0, r0 + nr) for r0, nr, _ in ranges)
        disjoint = all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        if len(counts) != 1 or not disjoint:
            raise NotImplementedError(
                f"the column shards of table {t!r} split its rows differently; a row-wise "
                "optimizer needs every column block split into the same row ranges"
            )


def _rounds(edges, n: int, total: int):
    """Greedy edge colouring: each round a partial permutation (one send, one receive)."""
    order = sorted(edges, key=lambda e: (-sum(v for _, _, v in edges[e]), e))
    rounds: list[tuple[set, set, list]] = []
    for e in order:
        a, b = e
        for senders, receivers, members in rounds:
            if a not in senders and b not in receivers:
                senders.add(a)
                receivers.add(b)
                members.append(e)
                break
        else:
            rounds.append(({a}, {b}, [e]))
    out = []
    for _, _, members in rounds:
        length = max(sum(v for _, _, v in edges[e]) for e in members)
        send = np.full((n, length), total, np.int32)
        recv = np.full((n, length), total, np.int32)
        for a, b in members:
            at = 0
            for base_a, base_b, v in edges[(a, b)]:
                send[a, at : at + v] = np.arange(base_a, base_a + v)
                recv[b, at : at + v] = np.arange(base_b, base_b + v)
                at += v
        out.append((tuple(sorted(members)), send, recv))
    return tuple(out)


def column_split_row_sum(schedule: PeerSchedule | None, rows_per_rank: int, axis):
    """``reduce(rows) -> (row_sum, width)`` for a group's unique local rows, or ``None``.

    ``rows`` ``[U]`` are distinct local rows (fill ``>= rows_per_rank``), in
    any order. ``row_sum(partial [U]) -> [U]`` completes per-row sums across
    peers; ``width [U]`` is each row's full embedding dim.
    """
    if schedule is None:
        return None
    k = schedule.offsets.shape[1] - 1

    def reduce(rows):
        me = jax.lax.axis_index(axis)
        o, base, size, wd = (
            jnp.asarray(x)[me]
            for x in (schedule.offsets, schedule.base, schedule.size, schedule.width)
        )
        j = jnp.clip(jnp.searchsorted(o, rows, side="right") - 1, 0, k)
        srt = jnp.sort(rows)
        ordinal = jnp.searchsorted(srt, rows) - jnp.searchsorted(srt, o[j])
        mine = (rows < rows_per_rank) & (base[j] >= 0) & (ordinal < size[j])
        pos = jnp.where(mine, base[j] + ordinal, schedule.total)

        def row_sum(partial):
            vec = jnp.zeros((schedule.total,), jnp.float32).at[pos].add(partial, mode="drop")
            total = vec
            for perm, send, recv in schedule.rounds:
                out = vec.at[jnp.asarray(send)[me]].get(mode="fill", fill_value=0)
                got = jax.lax.ppermute(out, axis, perm)
                total = total.at[jnp.asarray(recv)[me]].add(got, mode="drop")
            return jnp.where(mine, total.at[pos].get(mode="fill", fill_value=0), partial)

        return row_sum, wd[j]

    return reduce
