"""Fast-path id capacities of the sharded exchange, sized from input statistics.

A width group's ids travel to their shards in a fixed-size ``all_to_all``:
``capacity`` ids per (source, destination) pair. TorchRec sizes that buffer per
batch; jaxrec compiles fixed shapes, so the buffer is sized for the *expected*
load and ids beyond it take extra exchange rounds (exact, slower; see
``embedding_dist``). The expected load a destination receives from one source
is the sum over the slots it hosts (a feature reading a shard) of the
feature's mean ids per device times the share of the table's rows the shard
holds (ids spread over rows uniformly: hashed ids do; for skewed ids measure
the loads with :func:`jaxrec.distributed.suggest_capacity`).

The planner (``planner/cost_model.py``) and the sharded collections use this
one formula, so the planner prices exactly the buffers the collection builds.
"""

from __future__ import annotations

import math

CAPACITY_FACTOR = 1.1  # headroom over the mean load
SIGMAS = 3.0  # plus this many standard deviations of a Poisson load


def fast_path_capacity(expected: float, natural: int, factor: float = CAPACITY_FACTOR) -> int:
    """Ids per destination of a width group's fast path.

    ``ceil(factor * expected + 3 * sqrt(expected))``, at least 1 and at most
    ``natural`` (the most ids one destination can ever receive from one
    source: a capacity of ``natural`` never overflows).

    Args:
        expected: mean ids a destination receives from one source per step
            (the largest over destinations).
        natural: the largest possible payload, the sum of the capacities of
            the features a destination's slots read.
        factor: headroom multiplier (``capacity_factor=``), at least 1.

    Example:
        >>> fast_path_capacity(5120.0, natural=40960)
        5847
    """
    if not factor >= 1.0:
        raise ValueError(f"capacity_factor must be >= 1, got {factor!r}")
    if natural < 1:
        return 1
    if not expected > 0:
        return 1
    return int(min(natural, max(1, math.ceil(factor * expected + SIGMAS * math.sqrt(expected)))))
