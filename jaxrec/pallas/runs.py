"""The work plan of the fused backward: occurrences sorted into runs, long runs cut into pieces.

Every touched row gets one update with the sum of its occurrences' gradients
(a *run*: the occurrences of one row, contiguous once sorted by row). Ids are
skewed: a hot row may own a large share of a batch, and a program that walks
a whole run alone makes the kernel's time grow with the hottest row's count
while the rest of the GPU idles (FBGEMM splits such runs across thread
blocks for the same reason).

So no program walks more than ``piece_len`` items of one run. A run longer
than that is cut into pieces of ``piece_len`` consecutive occurrences; one
*reduction* launch sums every piece into a float32 *partial* row, and the run
is then represented by its partials. A run still longer than ``piece_len``
(more than ``piece_len**2`` occurrences) is cut again, partials of partials,
until every run has at most ``piece_len`` items; the update launch then sums
each run's items (occurrences, or the partials of its last level) and applies
the optimizer once. Sums follow a fixed order (sorted position, then piece),
so results are deterministic; with ``C`` occurrences there are at most
``ceil(log_piece_len(C)) - 1`` reductions, and each launch's programs walk at
most ``piece_len`` items each.

Everything here is XLA index arithmetic with static shapes (a sort, cumulative
sums and a search per level); the kernels in ``jaxrec.pallas.update`` read it.
:func:`program_loads` counts what each program of each launch walks, for the
structural tests and the benchmarks.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_PIECE_LEN = 32


@dataclasses.dataclass(frozen=True)
class PieceLayout:
    """Static sizes of the reductions for ``num_items`` occurrences.

    Attributes:
        piece_len: most items one program sums for one run (None: unbounded,
            one program walks a whole run and there are no reductions).
        sizes: piece slots of each reduction level (a bound: the live pieces
            of a batch are a prefix), so level ``k`` writes partial rows
            ``[offsets[k], offsets[k] + sizes[k])`` of one shared buffer.
    """

    piece_len: int | None
    sizes: tuple[int, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.sizes)[:-1])

    @property
    def total(self) -> int:
        return int(sum(self.sizes))


def piece_layout(num_items: int, piece_len: int | None) -> PieceLayout:
    """The reduction levels that bound every run of ``num_items`` occurrences to ``piece_len``.

    A run of ``n > p`` items becomes ``ceil(n / p) <= 2n / (p + 1)`` partials,
    so a level's pieces number at most ``2 / (p + 1)`` of the items it reduces
    (``floor`` of that is the static size), and after ``k`` levels no run has
    more than ``ceil(num_items / p**k)`` items: levels are added until that,
    or the previous level's size, is at most ``p``.

    Raises:
        ValueError: ``piece_len`` below 2 (a run would never shrink).
    """
    if piece_len is None:
        return PieceLayout(None, ())
    if piece_len < 2:
        raise ValueError(f"piece_len must be at least 2 (or None), got {piece_len}")
    sizes: list[int] = []
    items, longest = num_items, num_items
    while longest > piece_len and items > piece_len:
        items = 2 * items // (piece_len + 1)
        longest = -(-longest // piece_len)
        sizes.append(items)
    return PieceLayout(piece_len, tuple(sizes))


class Pieces(NamedTuple):
    """The pieces one reduction launch sums: slot ``i`` into partial row ``offset + i``.

    Items of the first level are sorted occurrence positions; deeper levels'
    are rows of the shared partial buffer. Empty slots have ``length == 0``.
    """

    start: jax.Array  # [N] int32 first item of each piece
    length: jax.Array  # [N] int32 items in the piece, <= piece_len


class RunPlan(NamedTuple):
    """Sorted occurrences, the reduction levels and what the update launch sums per run.

    Run ``u`` updates table row ``row[u]`` (``num_rows``: no run, skipped) with
    the sum of ``length[u]`` items from ``start[u]``: sorted occurrences
    (``src``/``scale``) or, where ``partial[u]``, rows of the partial buffer.
    """

    src: jax.Array  # [C] int32 output-gradient row of each sorted occurrence (0 when invalid)
    scale: jax.Array  # [C] float32 its multiplier (0 when invalid)
    levels: tuple[Pieces, ...]
    row: jax.Array  # [C] int32 table row of each run, num_rows for empty slots
    start: jax.Array  # [C] int32
    length: jax.Array  # [C] int32
    partial: jax.Array  # [C] int32, 1 where the run's items are partial rows


def plan_runs(
    rows: jax.Array,
    valid: jax.Array,
    segment_ids: jax.Array,
    scale: jax.Array,
    num_rows: int,
    layout: PieceLayout,
) -> RunPlan:
    """Sorts ``C`` occurrences by row into runs and cuts long runs per ``layout``.

    Args:
        rows: ``[C]`` int table rows; ``valid``: ``[C]`` bool, False skips.
        segment_ids: ``[C]`` output-gradient row of each occurrence.
        scale: ``[C]`` float multiplier of each occurrence's gradient.
        num_rows: rows of the table (the fill of empty run slots).
        layout: :func:`piece_layout` of ``(C, piece_len)``.

    Returns:
        The :class:`RunPlan` (arrays only; sizes are ``layout``'s).
    """
    c = rows.shape[0]
    keyed = jnp.where(valid, rows.astype(jnp.int32), num_rows)
    order = jnp.argsort(keyed, stable=True).astype(jnp.int32)
    sorted_rows = keyed[order]
    first = jnp.concatenate([jnp.ones((1,), bool), sorted_rows[1:] != sorted_rows[:-1]])
    (bounds,) = jnp.nonzero(first, size=c + 1, fill_value=c)
    bounds = bounds.astype(jnp.int32)
    start = bounds[:-1]
    run_row = jnp.where(start < c, sorted_rows[jnp.minimum(start, c - 1)], num_rows)
    length = jnp.where(run_row < num_rows, bounds[1:] - start, 0)
    src = jnp.where(sorted_rows < num_rows, segment_ids.astype(jnp.int32)[order], 0)
    occ_scale = jnp.where(valid, scale.astype(jnp.float32), 0.0)[order]
    partial = jnp.zeros((c,), jnp.int32)
    levels = []
    p = layout.piece_len or 0  # None: unbounded, and then there are no levels (sizes == ())
    for size, offset in zip(layout.sizes, layout.offsets, strict=True):
        long = length > p
        count = jnp.where(long, (length + p - 1) // p, 0)
        ends = jnp.cumsum(count, dtype=jnp.int32)
        first_piece = ends - count
        slot = jnp.arange(size, dtype=jnp.int32)
        run = jnp.searchsorted(ends, slot, side="right").astype(jnp.int32)
        live = run < c
        run = jnp.minimum(run, c - 1)
        chunk = slot - first_piece[run]
        levels.append(
            Pieces(
                start=jnp.where(live, start[run] + chunk * p, 0),
                length=jnp.where(live, jnp.minimum(p, length[run] - chunk * p), 0),
            )
        )
        start = jnp.where(long, offset + first_piece, start)
        length = jnp.where(long, count, length)
        partial = jnp.where(long, 1, partial)
    return RunPlan(src, occ_scale, tuple(levels), run_row, start, length, partial)


class ProgramLoad(NamedTuple):
    """What each program of one launch walks (host numpy, for tests and benchmarks)."""

    items: np.ndarray  # [programs] items summed (occurrences or partial rows)
    chain: np.ndarray  # [programs] longest serial walk: the most items of one run or piece


def program_loads(plan: RunPlan, block_rows: int) -> list[ProgramLoad]:
    """Per launch (each reduction level, then the update), the load of each program.

    A program owns ``block_rows`` consecutive pieces (or runs) and walks them in
    lock step, so its serial chain is its longest piece and its work the sum.
    """
    out = []
    for length in [lv.length for lv in plan.levels] + [plan.length]:
        n = np.asarray(length, np.int64)
        pad = (-n.shape[0]) % block_rows
        blocks = np.concatenate([n, np.zeros(pad, np.int64)]).reshape(-1, block_rows)
        out.append(ProgramLoad(items=blocks.sum(1), chain=blocks.max(1)))
    return out
