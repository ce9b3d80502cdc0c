"""``implementation=None | "xla" | "pallas"`` dispatch with fallback.

``None`` picks a registered Pallas kernel on GPU and XLA elsewhere. A kernel
that cannot handle its arguments raises ``NotImplementedError`` and the call
falls back to XLA. Kernels register themselves from ``jaxrec.pallas``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

IMPLEMENTATIONS = (None, "xla", "pallas")
_PALLAS: dict[str, Callable] = {}


def register_pallas(op: str, fn: Callable) -> None:
    _PALLAS[op] = fn


def dispatch(op: str, implementation: str | None, xla_fn: Callable, *args, **kwargs):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    kernel = _PALLAS.get(op)
    if implementation == "pallas" and kernel is None:
        raise NotImplementedError(
            f"no Pallas kernel is registered for {op!r}; use implementation='xla'"
        )
    use_pallas = implementation == "pallas" or (
        implementation is None and kernel is not None and jax.default_backend() == "gpu"
    )
    if use_pallas:
        try:
            return kernel(*args, **kwargs)
        except NotImplementedError:
            pass  # the kernel declined these arguments
    return xla_fn(*args, **kwargs)
