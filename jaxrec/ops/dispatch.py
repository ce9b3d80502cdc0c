"""``implementation=None | "xla" | "pallas" | "cpu"`` dispatch with fallback.

``None`` picks a registered Pallas kernel on GPU, the C++ CPU kernels
(``jaxrec.cpu``) on the CPU backend when they are built, and XLA elsewhere. A
kernel that cannot handle its arguments raises ``NotImplementedError`` and the
call falls back to XLA. Pallas kernels register themselves from
``jaxrec.pallas`` and CPU kernels from ``jaxrec.cpu``; each package is imported
the first time one of its kernels may be wanted (so importing jaxrec imports
neither). ``"cpu"`` runs XLA for ops without a CPU kernel, and when the
extension cannot be loaded (saying why, once: a warning when ``"cpu"`` was
asked for, a log line when ``None`` would have picked it).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

IMPLEMENTATIONS = (None, "xla", "pallas", "cpu")
# Whether ``implementation=None`` picks the C++ kernels on the CPU backend.
CPU_BY_DEFAULT = True
_PALLAS: dict[str, Callable] = {}
_CPU: dict[str, Callable] = {}
_LOADED = False
_CPU_LOADED = False


def register_pallas(op: str, fn: Callable) -> None:
    _PALLAS[op] = fn


def register_cpu(op: str, fn: Callable) -> None:
    _CPU[op] = fn


def _load_kernels() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        from .. import pallas  # noqa: F401  (registers its kernels)


def _load_cpu_kernels() -> None:
    global _CPU_LOADED
    if not _CPU_LOADED:
        _CPU_LOADED = True
        from .. import cpu  # noqa: F401  (registers its kernels; the .so loads on first use)


def _cpu_kernel(op: str, explicit: bool) -> Callable | None:
    """The op's C++ kernel if it is registered and loadable, else None (warning once)."""
    _load_cpu_kernels()
    kernel = _CPU.get(op)
    if kernel is None:
        return None
    from ..cpu import loader

    if loader.load() is not None:
        loader.warn_unavailable(explicit)
        return None
    return kernel


def _wants_cpu(implementation: str | None, backend: str) -> bool:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    return implementation == "cpu" or (
        implementation is None and backend == "cpu" and CPU_BY_DEFAULT
    )


def try_cpu(op: str, implementation: str | None, *args, **kwargs):
    """The op's C++ CPU kernel's result, or None when it is not selected or declines.

    For entry points whose only accelerated form is a CPU kernel (no Pallas
    twin): the caller runs its XLA path when this returns None.
    """
    if not _wants_cpu(implementation, jax.default_backend()):
        return None
    kernel = _cpu_kernel(op, explicit=implementation == "cpu")
    if kernel is None:
        return None
    try:
        return kernel(*args, **kwargs)
    except NotImplementedError:
        return None  # the kernel declined these arguments


def dispatch(op: str, implementation: str | None, xla_fn: Callable, *args, **kwargs):
    backend = jax.default_backend()
    if _wants_cpu(implementation, backend):
        kernel = _cpu_kernel(op, explicit=implementation == "cpu")
        if kernel is not None:
            try:
                return kernel(*args, **kwargs)
            except NotImplementedError:
                pass  # the kernel declined these arguments
        return xla_fn(*args, **kwargs)
    on_gpu = backend == "gpu"
    if implementation == "pallas" or (implementation is None and on_gpu):
        _load_kernels()
    kernel = _PALLAS.get(op)
    if implementation == "pallas" and kernel is None:
        raise NotImplementedError(
            f"no Pallas kernel is registered for {op!r}; use implementation='xla'"
        )
    use_pallas = implementation == "pallas" or (
        implementation is None and kernel is not None and on_gpu
    )
    if use_pallas:
        try:
            return kernel(*args, **kwargs)
        except NotImplementedError:
            pass  # the kernel declined these arguments
    return xla_fn(*args, **kwargs)
