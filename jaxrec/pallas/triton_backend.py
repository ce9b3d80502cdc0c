"""The one import of Pallas's Triton backend, guarded: JAX 0.11 deprecates it.

Every kernel module takes ``pl_triton`` from here, so ``import jaxrec`` works
on a JAX without the backend. Two ways it can be gone, both recorded:

* the module ``jax.experimental.pallas.triton`` (or a name the kernels use,
  ``load``/``store``/``CompilerParams``) does not import: checked at import;
  ``pl_triton`` is then a stand-in whose attributes raise
  :class:`TritonUnavailableError`;
* it imports but ``pallas_call`` no longer lowers with Triton compiler
  params: checked once, the first time :func:`available` is asked (by the
  dispatcher before it stages a kernel, by a kernel wrapper before its
  launch), by lowering a 16-lane kernel for CUDA in a thread of its own
  (deviceless; a fraction of a second, mostly Pallas's first-use cost that
  the kernels pay anyway).

When either holds, ``jaxrec.ops`` runs XLA where a kernel would have run and
warns once (:class:`PallasBackendWarning`); a direct kernel call raises
:class:`TritonUnavailableError` (a ``NotImplementedError``, the kernels'
"decline" signal) naming the cause. This module imports nothing of jaxrec.
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_MODULE = "jax.experimental.pallas.triton"
_USED = ("load", "store", "CompilerParams")  # what the kernels take from the module


class PallasBackendWarning(RuntimeWarning):
    """Pallas's Triton backend is missing from this JAX; the kernels' callers run XLA."""


class TritonUnavailableError(NotImplementedError):
    """A Pallas kernel was called on a JAX without Pallas's Triton backend."""


class _Missing:
    """Stands in for the module when it does not import: any use names the cause."""

    def __getattr__(self, name: str):
        if name.startswith("__"):  # introspection (copy, inspect.unwrap) sees a plain object
            raise AttributeError(name)
        raise TritonUnavailableError(f"{_MODULE}.{name} is unavailable: {_IMPORT_ERROR}")


def _import():
    try:
        from jax.experimental.pallas import triton as module
    except Exception as e:  # noqa: BLE001  (ImportError, or a JAX that fails inside it)
        return _Missing(), f"{_MODULE} does not import ({type(e).__name__}: {e})"
    missing = [name for name in _USED if not hasattr(module, name)]
    if missing:  # a deprecation shim left after the removal
        return _Missing(), f"{_MODULE} has no {', '.join(missing)}"
    return module, None


_MODULE_OR_STAND_IN, _IMPORT_ERROR = _import()
if TYPE_CHECKING:
    from jax.experimental.pallas import triton as pl_triton
else:
    pl_triton = _MODULE_OR_STAND_IN

_LOCK = threading.Lock()
_STATE: dict = {"probed": False, "reason": _IMPORT_ERROR, "warned": False}


def _probe() -> str | None:
    """Lowers a masked copy through Triton for CUDA; why it failed, or None."""

    def kernel(x_ref, o_ref):  # [16] float32 each
        i = jnp.arange(16, dtype=jnp.int32)
        pl_triton.store(o_ref.at[i], pl_triton.load(x_ref.at[i], mask=i < 8, other=0.0))

    def copy(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
            grid=(1,),
            compiler_params=pl_triton.CompilerParams(num_warps=1, num_stages=1),
        )(x)

    def lower(result):
        try:
            x = jax.ShapeDtypeStruct((16,), jnp.float32)
            jax.jit(copy).trace(x).lower(lowering_platforms=("cuda",))
        except Exception as e:  # noqa: BLE001  (any failure: the kernels would fail alike)
            first = (str(e).strip().splitlines() or [""])[0].rstrip(".")
            result.append(
                f"a Triton pallas_call does not lower for CUDA ({type(e).__name__}: {first})"
            )

    # In a thread of its own: the caller is usually tracing (inside jit, shard_map or a
    # mesh context), and JAX's trace and mesh contexts are per thread.
    result: list[str] = []
    with warnings.catch_warnings():  # JAX's own deprecation notice: not ours to repeat
        warnings.simplefilter("ignore", DeprecationWarning)
        thread = threading.Thread(target=lower, args=(result,), name="jaxrec-triton-probe")
        thread.start()
        thread.join()
    return result[0] if result else None


def unavailable_reason() -> str | None:
    """Why the Pallas kernels cannot run on this JAX (None when they can)."""
    with _LOCK:
        if not _STATE["probed"]:
            if _STATE["reason"] is None:
                _STATE["reason"] = _probe()
            _STATE["probed"] = True
        return _STATE["reason"]


def available() -> bool:
    """Whether JAX can import and lower Pallas's Triton backend (the kernels' only one)."""
    return unavailable_reason() is None


def require() -> None:
    """Raises :class:`TritonUnavailableError` when the kernels cannot run on this JAX.

    Called by every kernel wrapper before its launch (``Tiling.compiler_params``),
    so a direct call names the cause rather than failing inside JAX (even
    ``interpret=True``: the kernels are tested only where they lower).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise TritonUnavailableError(
            f"jaxrec.pallas kernels need Pallas's Triton backend, which JAX {jax.__version__} "
            f"cannot use: {reason}. Call the jaxrec.ops entry points instead (they run XLA), "
            "or install a JAX that still has it"
        )


def warn_unavailable() -> None:
    """Says once per process that the kernels are unavailable and XLA runs instead."""
    with _LOCK:
        if _STATE["warned"]:
            return
        _STATE["warned"] = True
    warnings.warn(
        f"jaxrec's Pallas kernels are unavailable: JAX {jax.__version__} cannot lower Pallas "
        f"to Triton: {unavailable_reason()}. Programs lowered for GPUs (and "
        "implementation='pallas') run the XLA path instead: the same results, without the "
        "fused kernels. To use the kernels, install a JAX that still has Pallas's Triton "
        "backend (jaxrec's are tested on JAX 0.10 and 0.11); to silence this, filter "
        "jaxrec.pallas.PallasBackendWarning.",
        PallasBackendWarning,
        stacklevel=2,
    )
