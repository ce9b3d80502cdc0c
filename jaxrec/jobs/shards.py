"""Which batches a process reads: its own devices' share of one global batch stream.

The job's global stream is the same for any number of processes: step ``s``
gives device (rank) ``r`` of ``world`` the dataset's batch ``s * world + r``
(in the order set by seed and epoch). A process reads only the batches of its
own ranks, so a run over several processes sees the very batches a
one-process run over as many devices does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import TypedDict, Unpack

from ..datasets import Batch, Part, TableDataset


class BatchOptions(TypedDict, total=False):
    """``TableDataset.batches``' keyword arguments that :func:`rank_batches` passes on."""

    shuffle: bool
    seed: int
    epoch: int
    capacities: Sequence[int] | None
    overflow: str


def rank_batches(
    data: TableDataset,
    batch_size: int,
    ranks: Sequence[int],
    world: int,
    *,
    drop_last: bool = True,
    **kwargs: Unpack[BatchOptions],
) -> Iterator[list[Batch | None]]:
    """Per step, the batches of ``ranks`` (of ``world`` devices), in that order.

    Args:
        data: a :class:`~jaxrec.datasets.TableDataset` (or anything with its
            ``batches(batch_size, part=Part(r, world), ...)``).
        batch_size: rows per device.
        ranks: this process's devices' positions in the mesh.
        world: devices over all processes.
        drop_last: ``False``: the rows after the last full step are spread over
            the ranks in one more step; a rank left without rows gets ``None``.
        kwargs: passed to ``data.batches`` (shuffle, seed, epoch, capacities).
    """
    # Steps over all ranks (every process must run as many): the one-process count.
    steps = data.num_batches(batch_size * world, drop_last=drop_last, part=Part(0, 1))
    # Rank r is the dataset's part r of world: the global batches s * world + r, and
    # only their rows are read. Without drop_last the tail's rows are split over the
    # ranks; some may get none.
    streams = [
        data.batches(batch_size, drop_last=drop_last, part=Part(r, world), **kwargs) for r in ranks
    ]
    groups = (list(g) for g in itertools.zip_longest(*streams))
    padding = itertools.repeat([None] * len(ranks))
    return itertools.islice(itertools.chain(groups, padding), steps)
