"""Capacity buckets: static array sizes for ragged data.

JAX compiles once per shape, so ragged inputs carry a static capacity (array
length) that is rounded up to a bucket. Buckets are powers of two and 1.5x
powers of two, so at most ~33% of a buffer is padding and a stream of batches
meets only a handful of shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

MIN_CAPACITY = 8


def bucket_capacity(n: int, *, minimum: int = MIN_CAPACITY) -> int:
    """Smallest bucket (2**k or 3 * 2**(k-1), at least ``minimum``) holding ``n`` items.

    Example:
        >>> [bucket_capacity(n) for n in (0, 8, 9, 13, 100)]
        [8, 8, 12, 16, 128]
    """
    if n < 0:
        raise ValueError(f"capacity must be non-negative, got {n=}")
    if n <= minimum:
        return minimum
    p = 1 << (n - 1).bit_length()  # next power of two >= n
    three_halves = 3 * p // 4
    return three_halves if three_halves >= n else p


class MonotoneCapacities:
    """Per-key capacities that only ever grow, for streams of batches.

    Bucketing each key independently makes the tuple of capacities change almost
    every batch when there are many keys; keeping each key's capacity at the
    largest bucket seen so far bounds the number of distinct shapes (and so of
    compiles) to a few per key over the whole stream.

    Example:
        >>> caps = MonotoneCapacities()
        >>> caps({"a": 5, "b": 20}), caps({"a": 3, "b": 30})
        ({'a': 8, 'b': 24}, {'a': 8, 'b': 32})
    """

    def __init__(self, initial: Mapping[str, int] | None = None, *, minimum: int = MIN_CAPACITY):
        self.minimum = minimum
        self._caps: dict[str, int] = dict(initial or {})

    def __call__(self, length_per_key: Mapping[str, int]) -> dict[str, int]:
        for key, n in length_per_key.items():
            cap = self._caps.get(key, 0)
            if n > cap:
                self._caps[key] = bucket_capacity(int(n), minimum=self.minimum)
        return {key: self._caps[key] for key in length_per_key}


def resolve_capacities(
    keys: Sequence[str],
    length_per_key: Sequence[int] | None,
    capacities: Mapping[str, int] | Sequence[int] | int | None,
) -> tuple[int, ...]:
    """Per-key capacities from a user setting, checking that every key fits.

    ``None`` buckets each key's total length; an ``int`` is one capacity for
    every key; a mapping or sequence gives each key its own. Without
    ``length_per_key`` nothing is checked against the data.
    """
    if capacities is None:
        if length_per_key is None:
            raise ValueError("capacities=None needs the lengths to bucket")
        return tuple(bucket_capacity(int(n)) for n in length_per_key)
    if isinstance(capacities, int):
        caps = [capacities] * len(keys)
    elif isinstance(capacities, Mapping):
        missing = [k for k in keys if k not in capacities]
        if missing:
            raise ValueError(f"capacities has no entry for keys {missing}; give one per key")
        caps = [int(capacities[k]) for k in keys]
    else:
        caps = [int(c) for c in capacities]
        if len(caps) != len(keys):
            raise ValueError(
                f"capacities has {len(caps)} entries for {len(keys)} keys {list(keys)}"
            )
    if any(c < 0 for c in caps):
        raise ValueError(f"capacities must be non-negative, got {caps}")
    for key, n, cap in zip(keys, length_per_key or [0] * len(keys), caps, strict=True):
        if n > cap:
            raise ValueError(
                f"key {key!r} has {n} values but its capacity is {cap}; "
                f"raise its capacity to at least {bucket_capacity(int(n))} "
                "(batch size x max pooling factor)"
            )
    return tuple(caps)
