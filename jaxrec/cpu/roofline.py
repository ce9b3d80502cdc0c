"""The machine's ceilings for a pooled lookup's memory access, from the C++ extension.

Benchmarks report each kernel's time as a fraction of these: a sequential
read of a buffer and a gather of table rows by id, each summed in registers
(nothing written but one row of sums per thread), and the gather summed per
bag into written rows (a pooled lookup's own traffic: at one id per bag it
writes as much as it reads). Timed inside C++ with the GIL released; none is
used by the lookups themselves.
"""

from __future__ import annotations

import numpy as np

from .loader import load


def _kernels():
    reason = load()
    if reason is not None:
        raise RuntimeError(f"jaxrec's C++ CPU kernels are unavailable: {reason}")
    from . import _kernels

    return _kernels


def read_bandwidth(data: np.ndarray, threads: int) -> tuple[float, float]:
    """Reads every float of ``data`` once, split over ``threads`` threads.

    Args:
        data: a C-contiguous 1-d float32 array (a read-only view is fine).
        threads: threads to split the read over, each a contiguous part.

    Returns:
        ``(seconds, sum)``: the time of the read and the sum of the values (a
        checksum; summed lane-wise in float32, so not ``data.sum()`` bit for bit).

    Example:
        >>> s, _ = read_bandwidth(np.ones(1 << 24, np.float32), 2)  # doctest: +SKIP
        >>> (1 << 26) / s / 1e9  # GB/s
    """
    data = np.ascontiguousarray(data, np.float32).reshape(-1)
    return _kernels().read_bandwidth(data, int(threads))


def gather_rows(
    table: np.ndarray, ids: np.ndarray, threads: int, ahead: int = 16
) -> tuple[float, np.ndarray]:
    """Sums rows ``table[ids]``, the ids split over ``threads`` threads in contiguous parts.

    The loop a pooled lookup of one bag holding every id would run, without
    bags, weights or bounds checks: each row's cache lines are prefetched
    ``ahead`` rows before it is read (``0``: no prefetch).

    Args:
        table: a C-contiguous ``[R, D]`` float32 array.
        ids: ``[N]`` row ids in ``[0, R)`` (cast to int32).
        threads: threads to split the ids over.
        ahead: rows prefetched ahead of the one being summed.

    Returns:
        ``(seconds, sums)``: the time of the gather and the ``[D]`` float32
        column sums of the rows (equal to ``table[ids].sum(0)`` up to float32
        summation order).

    Raises:
        ValueError: an id is outside ``[0, R)``.
    """
    if table.ndim != 2:
        raise ValueError(f"table must be [R, D], got {table.shape=}")
    table = np.ascontiguousarray(table, np.float32)
    ids = np.ascontiguousarray(ids, np.int32).reshape(-1)
    seconds, sums = _kernels().gather_rows(table, ids, int(threads), int(ahead))
    return seconds, np.asarray(sums, np.float32)


def gather_pool_rows(
    table: np.ndarray, ids: np.ndarray, out: np.ndarray, threads: int, ahead: int = 16
) -> float:
    """Sums each run of ``per = N // G`` consecutive ids' rows into a row of ``out``.

    :func:`gather_rows` with the forward's output: ``out[g] = table[ids[g * per :
    (g + 1) * per]].sum(0)``, each row of ``out`` written once, in order, runs
    split over ``threads`` threads; rows prefetched ``ahead`` ids before. Pass
    the same ``out`` to every timed call, as a lookup's output buffer is
    reused: a fresh one would time its page faults.

    Args:
        table: a C-contiguous ``[R, D]`` float32 array.
        ids: ``[N]`` int32 row ids in ``[0, R)``.
        out: a C-contiguous, writable ``[G, D]`` float32 array, ``N`` a multiple of ``G``.
        threads: threads to split the runs over.
        ahead: rows prefetched ahead of the one being summed.

    Returns:
        The seconds taken; ``out`` holds the sums (in id order).

    Raises:
        ValueError: an id outside ``[0, R)``, or ``out`` of another shape.
    """
    if table.ndim != 2 or out.ndim != 2 or out.shape[0] == 0 or ids.size % out.shape[0]:
        raise ValueError(
            f"table must be [R, D] and out [G, D] with G dividing the ids, got "
            f"{table.shape=} {out.shape=} {ids.size=}"
        )
    table = np.ascontiguousarray(table, np.float32)
    ids = np.ascontiguousarray(ids, np.int32).reshape(-1)
    per = ids.size // out.shape[0]
    return _kernels().gather_pool_rows(table, ids, per, out, int(threads), int(ahead))
