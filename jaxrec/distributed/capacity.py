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
from collections.abc import Mapping

import numpy as np

from .layout import WidthGroup

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


def natural_load(caps: Mapping[str, int], slots_per_rank) -> int:
    """The most ids one source can send one destination: its slots' whole capacities."""
    return max(1, max(sum(caps[s.key] for s in slots) for slots in slots_per_rank))


def expected_load(
    caps: Mapping[str, int],
    stride: int | Mapping[str, int],
    slots_per_rank,
    pooling_factors: Mapping[str, float] | None = None,
) -> float:
    """Mean ids one source sends its busiest destination.

    A feature's mean ids per device is ``stride * pooling_factors[key]``
    (capped at its capacity), or its whole capacity when no pooling factor is
    given; a slot receives the share of them its shard's rows hold. ``stride``:
    ``B``, or ``{key: B_k}`` for a variable batch per key (VBE).
    """
    pf = pooling_factors or {}
    per_key = stride if isinstance(stride, Mapping) else dict.fromkeys(caps, stride)

    def mean_ids(key: str) -> float:
        if key not in pf:
            return float(caps[key])
        return min(float(caps[key]), per_key[key] * float(pf[key]))

    return max(  # fsum: the planner's sum, to the last bit, whatever the order
        math.fsum(mean_ids(s.key) * s.nrows / max(s.table_rows, 1) for s in slots)
        for slots in slots_per_rank
    )


def group_capacity(
    caps: Mapping[str, int],
    stride: int | Mapping[str, int],
    group: WidthGroup,
    *,
    capacity: int | Mapping[str, int] | None = None,
    pooling_factors: Mapping[str, float] | None = None,
    factor: float = CAPACITY_FACTOR,
) -> int:
    """The fast-path capacity of ``group`` for a batch with key capacities ``caps``.

    ``capacity``: an int for every group, ``{group name: int}`` for some, or
    ``None``: sized from :func:`expected_load` by :func:`fast_path_capacity`.
    A given capacity above the natural payload is lowered to it.
    """
    natural = natural_load(caps, group.slots)
    given = capacity.get(group.name) if isinstance(capacity, Mapping) else capacity
    if given is not None:
        return max(1, min(int(given), natural))
    expected = expected_load(caps, stride, group.slots, pooling_factors)
    return fast_path_capacity(expected, natural, factor)


def check_capacity(capacity: object) -> None:
    """``capacity=`` must be ``None``, a positive int or ``{group name: positive int}``."""
    values = capacity.values() if isinstance(capacity, Mapping) else [capacity]
    for v in values:
        if v is None and not isinstance(capacity, Mapping):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(
                "capacity must be None (sized from input statistics), a positive int (ids per "
                f"destination per width group) or {{group name: positive int}}, got {capacity!r}"
            )


def measured_loads(group: WidthGroup, kjt) -> list[int]:
    """Ids one device's batch ``kjt`` (a host KJT) sends each destination of ``group``."""
    kjt = kjt.narrow_ids()  # id words -> int32 rows: a wide id is sent nowhere
    keys = list(kjt.keys())
    offsets = kjt.capacity_offsets()
    values = np.asarray(kjt.values())
    valid = np.asarray(kjt.segment_ids()) < kjt.bag_offsets()[-1]
    out = []
    for slots in group.slots:
        n = 0
        for s in slots:
            k = keys.index(s.key)
            ids = values[offsets[k] : offsets[k + 1]]
            ok = valid[offsets[k] : offsets[k + 1]]
            n += int(np.sum(ok & (ids >= s.row0) & (ids < s.row0 + s.nrows)))
        out.append(n)
    return out
