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
from typing import Any


def rank_batches(
    data: Any,
    batch_size: int,
    ranks: Sequence[int],
    world: int,
    *,
    drop_last: bool = True,
    **kwargs: Any,
) -> Iterator[list]:
    """Per step, the batches of ``ranks`` (of ``world`` devices), in that order.

    Args:
        data: a :class:`~jaxrec.datasets.TableDataset` (or anything with its
            ``batches(batch_size, process_index=, process_count=, ...)``).
        batch_size: rows per device.
        ranks: this process's devices' positions in the mesh.
        world: devices over all processes.
        drop_last: ``False``: the rows after the last full step are spread over
            the ranks in one more step; a rank left without rows gets ``None``.
        kwargs: passed to ``data.batches`` (shuffle, seed, epoch, capacities).
    """
    # Steps over all ranks (every process must run as many): the one-process count.
    steps = data.num_batches(
        batch_size * world, drop_last=drop_last, process_index=0, process_count=1
    )
    if world == 1 or len(getattr(data, "tables", ())) == 1:
        # One table: the dataset's row-level sharding with a "process" per rank gives
        # rank r the global batches s * world + r, and builds only those. Without
        # drop_last the tail's rows are split over the ranks; some may get none.
        streams = [
            data.batches(
                batch_size, drop_last=drop_last, process_index=r, process_count=world, **kwargs
            )
            for r in ranks
        ]
        groups = (list(g) for g in itertools.zip_longest(*streams))
    else:
        # Several files: the dataset would shard files over processes (another stream),
        # so every process reads the one-process stream and keeps its ranks' batches.
        stream = data.batches(
            batch_size, drop_last=drop_last, process_index=0, process_count=1, **kwargs
        )
        groups = (
            [group[r] if r < len(group) else None for r in ranks]
            for group in iter(lambda: list(itertools.islice(stream, world)), [])
        )
    padding = itertools.repeat([None] * len(ranks))
    return itertools.islice(itertools.chain(groups, padding), steps)
