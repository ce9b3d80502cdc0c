"""jaxrec's C++ CPU kernels (``implementation="cpu"``), registered through the XLA FFI.

The kernels are an optional extension (``jaxrec/cpu/_kernels``, built from
``csrc/`` by ``pip install``). They are loaded and registered with JAX the
first time one may run (after the backend has started). If the extension is
missing or fails to load, :func:`load` says why; the dispatcher then runs the
XLA path and warns once. ``jaxrec.ops.backends`` lists which wrapper serves
which op; this package imports nothing of ``jaxrec.ops``.

Threads: ``JAXREC_CPU_THREADS`` (default: every core the process may use).

The names below load on first use (PEP 562), so ``jaxrec.cpu.hugepages`` imports
without JAX: ``jaxrec-train-dlrm`` restarts itself with huge pages before JAX loads.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same names, for type checkers (import-linter reads them too)
    from .kernels import backward_update_cpu as backward_update_cpu
    from .kernels import embedding_bag_cpu as embedding_bag_cpu
    from .kernels import grouped_pooled_lookup_cpu as grouped_pooled_lookup_cpu
    from .kernels import kjt_backward_update_cpu as kjt_backward_update_cpu
    from .loader import available as available
    from .loader import build_info as build_info
    from .loader import host_functions as host_functions
    from .loader import load as load
    from .loader import unavailable_reason as unavailable_reason
    from .roofline import gather_pool_rows as gather_pool_rows
    from .roofline import gather_rows as gather_rows
    from .roofline import read_bandwidth as read_bandwidth

# Each public name and the module that defines it.
_SOURCES = {
    "backward_update_cpu": "kernels",
    "embedding_bag_cpu": "kernels",
    "grouped_pooled_lookup_cpu": "kernels",
    "kjt_backward_update_cpu": "kernels",
    "available": "loader",
    "build_info": "loader",
    "host_functions": "loader",
    "load": "loader",
    "unavailable_reason": "loader",
    "gather_pool_rows": "roofline",
    "gather_rows": "roofline",
    "read_bandwidth": "roofline",
}
__all__ = list(_SOURCES)


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_SOURCES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
