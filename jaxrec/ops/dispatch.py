"""``implementation=None | "xla" | "pallas"`` dispatch with fallback.

``None`` picks a registered Pallas kernel on GPU and XLA elsewhere. A kernel
that cannot handle its arguments raises ``NotImplementedError`` and the call
falls back to XLA. Kernels register themselves from ``jaxrec.pallas``, which
is imported here the first time a kernel may be wanted (so importing jaxrec
does not import Pallas on CPU).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

IMPLEMENTATIONS = (None, "xla", "pallas")
_PALLAS: dict[str, Callable] = {}
_LOADED = False


def register_pallas(op: str, fn: Callable) -> None:
    _PALLAS[op] = fn


def _load_kernels() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        from .. import pallas  # noqa: F401  (registers its kernels)


def dispatch(op: str, implementation: str | None, xla_fn: Callable, *args, **kwargs):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    on_gpu = jax.default_backend() == "gpu"
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
