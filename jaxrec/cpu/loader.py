"""Loads the C++ extension once and registers its FFI targets with JAX."""

from __future__ import annotations

import logging
import threading
import warnings

import jax

logger = logging.getLogger("jaxrec")

TARGETS = (
    "jaxrec_embedding_bag",
    "jaxrec_kjt_embedding_bag",
    "jaxrec_backward_update_sgd",
    "jaxrec_backward_update_rowwise_adagrad",
    "jaxrec_backward_update_adagrad",
    "jaxrec_kjt_backward_update_sgd",
    "jaxrec_kjt_backward_update_rowwise_adagrad",
    "jaxrec_kjt_backward_update_adagrad",
    "jaxrec_cache_move",
    "jaxrec_uniform_rows",
)
# Registered when the build has them (an older build still registers TARGETS; their
# callers ask has_target and run XLA without).
OPTIONAL_TARGETS = ("jaxrec_cache_plan_sets", "jaxrec_zch_train_step", "jaxrec_zch_remap")

_LOCK = threading.Lock()
_STATE: dict = {"done": False, "reason": None, "info": None, "warned": False, "optional": ()}


class CpuKernelWarning(RuntimeWarning):
    """The C++ CPU kernels were asked for but cannot run; XLA runs instead."""


def load() -> str | None:
    """Loads and registers the kernels (once); returns why they are unavailable, or None."""
    with _LOCK:
        if not _STATE["done"]:
            _STATE["reason"] = _load()
            _STATE["done"] = True
        return _STATE["reason"]


def _load() -> str | None:
    try:
        backend = jax.default_backend()  # starts the backend before registering
    except RuntimeError as e:
        return f"no JAX backend ({e})"
    if backend != "cpu":
        return f"the default JAX backend is {backend!r}, not 'cpu'"
    try:
        from . import _kernels
    except ImportError as e:
        return (
            f"the extension jaxrec.cpu._kernels is not importable ({e}); reinstall jaxrec "
            "with a C++17 compiler on the PATH (pip install -e . builds it)"
        )
    try:
        handlers = _kernels.handlers()
        for name in TARGETS:
            jax.ffi.register_ffi_target(name, handlers[name], platform="cpu")
        optional = tuple(name for name in OPTIONAL_TARGETS if name in handlers)
        for name in optional:
            jax.ffi.register_ffi_target(name, handlers[name], platform="cpu")
        _STATE["optional"] = optional
        _STATE["info"] = dict(_kernels.info())
    except Exception as e:  # noqa: BLE001  (any failure: use XLA)
        return f"registering the FFI targets failed ({type(e).__name__}: {e})"
    return None


def available() -> bool:
    """Whether the C++ CPU kernels are loaded and registered."""
    return load() is None


def has_target(name: str) -> bool:
    """Whether the kernels are registered and the build has FFI target ``name`` (one of
    :data:`OPTIONAL_TARGETS` may be missing from an older build)."""
    return load() is None and (name in TARGETS or name in _STATE["optional"])


def unavailable_reason() -> str | None:
    """Why the kernels cannot run (None when they can)."""
    return load()


def build_info() -> dict | None:
    """``{"vector_bytes", "max_threads", "ffi_api_minor", "cache_api", "uniform_rows_f16"}``
    of the loaded build."""
    load()
    return _STATE["info"]


def warn_unavailable(explicit: bool) -> None:
    """Says once why the kernels cannot run: a warning when ``implementation="cpu"``
    was asked for, a log line when ``None`` would have picked them."""
    with _LOCK:
        if _STATE["warned"]:
            return
        _STATE["warned"] = True
    msg = f"jaxrec's C++ CPU kernels are unavailable: {load()}; using the XLA path"
    if explicit:
        warnings.warn(msg, CpuKernelWarning, stacklevel=4)
    else:
        logger.warning(msg)


CACHE_API = 3  # csrc/jaxrec_cpu.cc's Info(): the cache_* functions' signatures


def host_functions():
    """The extension's plain host functions (``cache_scan``, ``cache_assign``,
    ``cache_fix``, ``cache_rows``: ``jaxrec.cache``'s passes and row copies), or None when it
    is not built. Unlike the FFI kernels these need no CPU backend (a GPU job's host
    runs them too)."""
    try:
        from . import _kernels
    except ImportError:
        return None
    built = _kernels.info().get("cache_api")
    if built != CACHE_API:  # a stale build: its cache_* functions take other arguments
        logger.warning(
            "jaxrec's C++ extension is stale (cache_api %s, this jaxrec needs %s): jaxrec.cache "
            "runs its numpy passes (the same slots, slower); rebuild it: pip install -e .",
            built,
            CACHE_API,
        )
        return None
    return _kernels
