"""The C++ passes of the cache (``jaxrec.cpu.host_functions``), or None without the
extension (numpy then does the same work)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..cpu import host_functions


class HostKernels(Protocol):
    """The extension's host functions the cache calls (``csrc/jaxrec_cpu.cc``; they
    check their arrays' dtypes and sizes and raise ``ValueError`` / ``TypeError``)."""

    def cache_scan(
        self,
        ids: np.ndarray,
        slot_of_row: np.ndarray,
        slots: int,
        miss: np.ndarray,
        n_miss: int,
        out: np.ndarray,
        base: int,
        marks: np.ndarray,
        /,
    ) -> tuple[int, int]: ...

    def cache_assign(
        self,
        fill_rows: np.ndarray,
        slot_of_row: np.ndarray,
        row_of_slot: np.ndarray,
        last_used: np.ndarray,
        counts: np.ndarray,
        used: int,
        clock: int,
        fill_slots: np.ndarray,
        evict_rows: np.ndarray,
        marks: np.ndarray,
        log: np.ndarray,
        pos: np.ndarray,
        ends: np.ndarray,
        order: object,
        /,
    ) -> int: ...

    def cache_fix(
        self,
        ids: np.ndarray,
        slot_of_row: np.ndarray,
        slots: int,
        base: int,
        out: np.ndarray,
        counts: np.ndarray,
        /,
    ) -> None: ...

    def cache_rows(
        self, src: np.ndarray, rows: np.ndarray, dst: np.ndarray, scatter: bool, /
    ) -> None: ...

    def lfu_order(self) -> object:
        """A new C++ LFU victim order (a capsule: ``cache_assign``'s ``order``)."""
        ...

    def lfu_reset(self, order: object, /) -> None: ...


kernels: HostKernels | None = host_functions()
AVAILABLE = kernels is not None


def require() -> HostKernels:
    """:data:`kernels`, where the caller checked :data:`AVAILABLE` (or took a path that
    only runs with it, as ``SlotMap.native``)."""
    if kernels is None:
        raise RuntimeError("jaxrec's C++ extension (jaxrec.cpu._kernels) is not built")
    return kernels
