"""Prepared batches not loaded yet: what the device's slots hold meanwhile.

``prepare`` changes the slot maps at once; the rows move only when the batch is
loaded. While a pipeline has batches prefetched, the maps are ahead of the device.
"""

from __future__ import annotations

import numpy as np

from .slots import Move


def device_rows(slots: np.ndarray, rows: np.ndarray, later: list[Move]) -> tuple:
    """``(slots, rows)`` the device holds: the maps' ``slots`` -> ``rows`` (which count
    every prepared batch) less the moves of the batches not loaded yet, ``later`` (a
    :class:`Move` each, in prepare order). A slot
    such a batch moves holds the row the first of them evicts from it; a slot it fills
    first (never used before) holds no row yet."""
    if not later:
        return slots, rows
    none = np.full(0, -1, np.int64)
    moved = np.concatenate([none, *(x for fs, _, es, _ in later for x in (es, fs))])
    held = np.concatenate(
        [
            none,
            *(
                x
                for fs, _, es, er in later  # a batch evicts, then fills
                for x in (er, np.full(len(fs), -1, np.int64))
            ),
        ]
    )
    first, at = np.unique(moved, return_index=True)
    held = held[at]
    keep = ~np.isin(slots, first)
    return (
        np.concatenate([slots[keep], first[held >= 0]]),
        np.concatenate([rows[keep], held[held >= 0]]),
    )
