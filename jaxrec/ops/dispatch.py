"""``implementation=None | "xla" | "pallas" | "cpu"`` dispatch, resolved per lowering platform.

The program that runs a lookup may be compiled for another platform than the
one this process runs on (ahead-of-time compilation for GPUs, multi-platform
``jax.export``), so the choice is not made from ``jax.default_backend()``:
each call stages one branch per platform with ``jax.lax.platform_dependent``
and XLA keeps only the branch of the platform it compiles for. The branches:

================  =====================  =======================  ===================
implementation    ``cpu``                ``cuda`` / ``rocm``      others
================  =====================  =======================  ===================
``None``          C++ kernel (if built)  Pallas kernel (*)        XLA
``"cpu"``         C++ kernel             XLA                      XLA
``"pallas"``      Pallas, interpreted    Pallas kernel, compiled  Pallas, interpreted
``"xla"``         XLA                    XLA                      XLA
``"mosaic_gpu"``  as ``None``            Mosaic GPU kernel (**)   XLA
================  =====================  =======================  ===================

(*) for the ops in ``jaxrec.ops.backends.GPU_DEFAULT_PALLAS``, those whose
kernel was measured faster than XLA on a GPU (or never slower); XLA for the
others.

(**) for the ops in ``jaxrec.ops.backends.MOSAIC_GPU`` (the pooled lookup;
Hopper and later); every other op runs as with ``None``. Off GPUs it never
runs the Mosaic interpreter (its callbacks cannot sit in a platform branch):
call ``jaxrec.pallas.mosaic_pooled.pooled_lookup_mosaic(..., interpret=True)``.

A kernel that cannot handle its arguments raises ``NotImplementedError`` and
its branch runs XLA instead. Which kernel serves an op is listed in
``jaxrec.ops.backends`` (Pallas adapters from ``jaxrec.pallas``, C++ wrappers
from ``jaxrec.cpu``). The C++ extension itself loads the first time a CPU
kernel may run; when it cannot be loaded, the CPU branch runs XLA (saying why
once: a warning when ``"cpu"`` was asked for, a log line for ``None``). On a JAX
that cannot import or lower Pallas's Triton backend, the Pallas branches run
XLA and ``jaxrec.pallas.PallasBackendWarning`` says so once per process.

Bounds-check reports made inside a branch (the C++ lookup counts bad ids
itself) leave it as outputs and are reported again outside
(``jaxrec.xla.bounds.collect_checks``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Final, Literal, TypeVar

import jax
import jax.numpy as jnp

from ..cpu import loader
from ..pallas import triton_backend
from ..xla.bounds import collect_checks, report_out_of_range
from .backends import CPU, GPU_DEFAULT_PALLAS, MOSAIC_GPU, PALLAS

T = TypeVar("T")  # an op's output: every kernel returns what its XLA path does

Implementation = Literal["xla", "pallas", "cpu", "mosaic_gpu"] | None
"""Which kernels a lookup or update runs: ``None`` (chosen per lowering platform:
C++ on CPU, Pallas on GPUs, XLA elsewhere), ``"xla"``, ``"pallas"``, ``"cpu"`` or
``"mosaic_gpu"`` (see the table of ``jaxrec.ops.dispatch``)."""
IMPLEMENTATIONS: tuple[Implementation, ...] = (None, "xla", "pallas", "cpu", "mosaic_gpu")
GPU_PLATFORMS = ("cuda", "rocm")
CPU_BY_DEFAULT: Final = True
"""Whether ``implementation=None`` picks the C++ kernels on the CPU platform. A constant
(``Final``: the type checker refuses assignments to it, here or as
``dispatch.CPU_BY_DEFAULT = ...``): to run XLA on the CPU, pass ``implementation="xla"``."""
# The platform whose branch is being traced (None outside any branch): calls
# nested in a branch choose directly instead of staging branches again.
_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxrec_platform", default=None
)


def _cpu_kernel(op: str, explicit: bool) -> Callable | None:
    """The op's C++ kernel if it has one and the extension loads, else None (warning once)."""
    kernel = CPU.get(op)
    if kernel is None:
        return None
    if loader.load() is not None:
        loader.warn_unavailable(explicit)
        return None
    return kernel


def _check(implementation: Implementation) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


def _wants_cpu(implementation: Implementation) -> bool:
    default = implementation is None or implementation == "mosaic_gpu"  # as None on CPU
    return implementation == "cpu" or (default and CPU_BY_DEFAULT)


def _kernel_for(op: str, implementation: Implementation, platform: str) -> Callable | None:
    """The kernel ``op`` runs on ``platform`` (``"default"``: any other), None for XLA."""
    if implementation == "xla":
        return None
    if implementation == "mosaic_gpu":
        kernel = MOSAIC_GPU.get(op)
        if kernel is not None and platform in GPU_PLATFORMS:
            return lambda *a, **k: kernel(*a, interpret=False, **k)
        implementation = None  # no Mosaic GPU kernel, or not a GPU: as the default
    if platform == "cpu" and _wants_cpu(implementation):
        return _cpu_kernel(op, explicit=implementation == "cpu")
    on_gpu = platform in GPU_PLATFORMS
    if implementation == "pallas" or (implementation is None and on_gpu and _gpu_default(op)):
        kernel = PALLAS.get(op)
        if kernel is None:
            if implementation == "pallas":
                raise NotImplementedError(
                    f"no Pallas kernel serves {op!r} (jaxrec.ops.backends.PALLAS); "
                    "use implementation='xla'"
                )
            return None
        if not triton_backend.available():  # a JAX without Pallas's Triton lowering
            triton_backend.warn_unavailable()
            return None
        return lambda *a, **k: kernel(*a, interpret=not on_gpu, **k)
    return None


def _gpu_default(op: str) -> bool:
    """Whether ``implementation=None`` runs ``op``'s Pallas kernel on GPUs."""
    return op in PALLAS and op in GPU_DEFAULT_PALLAS


def dispatch(
    op: str, implementation: Implementation, xla_fn: Callable[..., T], *args, **kwargs
) -> T:
    """``op``'s kernel for the lowering platform, else ``xla_fn``.

    ``implementation``: ``None``, ``"xla"``, ``"pallas"``, ``"cpu"`` or
    ``"mosaic_gpu"``, as in the
    table above.
    """
    _check(implementation)

    def run(platform):
        kernel = _kernel_for(op, implementation, platform)
        if kernel is not None:
            try:
                return kernel(*args, **kwargs)
            except NotImplementedError:
                pass  # the kernel declined these arguments
        return xla_fn(*args, **kwargs)

    if implementation == "xla":
        return xla_fn(*args, **kwargs)
    # An op that runs XLA on GPUs too: one branch, traced once.
    xla_on_gpu = op not in PALLAS or (implementation is None and not _gpu_default(op))
    xla_on_gpu = xla_on_gpu and not (implementation == "mosaic_gpu" and op in MOSAIC_GPU)
    return by_platform(run, inputs=(args, kwargs), gpu_as_default=xla_on_gpu)


def try_cpu(
    op: str, implementation: Implementation, fallback: Callable[[], T], *args, **kwargs
) -> T:
    """The op's C++ kernel where the program runs on CPU, ``fallback()`` elsewhere.

    For entry points whose only accelerated form is a CPU kernel (no Pallas
    twin); ``fallback`` also runs when the kernel declines its arguments.
    ``implementation``: ``None``, ``"cpu"`` or ``"mosaic_gpu"`` try the kernel;
    ``"xla"`` and ``"pallas"`` run ``fallback()``.
    """
    _check(implementation)
    if not _wants_cpu(implementation) or _cpu_kernel(op, implementation == "cpu") is None:
        return fallback()

    def run(platform):
        if platform == "cpu":
            try:
                return CPU[op](*args, **kwargs)
            except NotImplementedError:
                pass  # the kernel declined these arguments
        return fallback()

    return by_platform(run, inputs=(args, kwargs))


def by_platform(run: Callable[[str], T], inputs=(), gpu_as_default: bool = False) -> T:
    """``run(platform)`` for the platform the program is lowered for.

    ``run`` is traced once for CPU, once for GPUs and once for any other
    platform (``"default"``); calls nested in a branch see its platform and run
    directly (so a C++-or-fallback choice keeps the fallback's own kernels).
    Reports made inside a branch leave it as outputs (they must be the same
    checks in every branch) and are reported here. Inside a
    ``shard_map``, outputs vary over every mesh axis some array of ``inputs``
    varies over (an FFI call's outputs carry no such type, an XLA path's do,
    and the branches must agree).
    """
    vma = frozenset().union(*(_vma(x) for x in jax.tree.leaves(inputs)))
    known = _PLATFORM.get()
    if known is not None:
        return run(known)
    kinds: list = []

    def branch(platform):
        def traced():
            token = _PLATFORM.set(platform)
            try:
                with collect_checks(warnings=True) as checks:
                    out = run(platform)
            finally:
                _PLATFORM.reset(token)
            reports = checks.by_mode()
            kind = [(r.where, mode) for mode, r in reports]
            if kinds and kind != kinds[0]:
                raise AssertionError(
                    f"platform branches report different checks: {kinds[0]} / {kind}"
                )
            kinds.append(kind)
            return _varying((out, [(r.count, _widen(r.example)) for _, r in reports]), vma)

        return traced

    # One branch object for every GPU platform: platform_dependent joins equal
    # branches, so the GPU code is traced once (GPU platforms choose alike).
    default = branch("default")
    gpu = default if gpu_as_default else branch(GPU_PLATFORMS[0])
    per_platform = {"cpu": branch("cpu"), **{p: gpu for p in GPU_PLATFORMS}}
    out, counts = jax.lax.platform_dependent(default=default, **per_platform)
    for (where, mode), (count, example) in zip(kinds[0], counts, strict=True):
        report_out_of_range(count, example, mode, where)
    return out


def _vma(x) -> frozenset:
    """Mesh axes ``x`` varies over inside a ``shard_map`` (JAX 0.10: ``aval.mat.varying``)."""
    if not isinstance(x, jax.Array):
        return frozenset()
    return frozenset(getattr(getattr(jax.typeof(x), "mat", None), "varying", ()))


def _varying(tree, vma: frozenset):
    """``tree`` with every array cast to vary over ``vma`` too (a no-op outside shard_map)."""
    if not vma:
        return tree

    def cast(x):
        missing = tuple(sorted(vma - _vma(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def _widen(example: jax.Array) -> jax.Array:
    """Narrow integer examples as int32: branches may find the same id in different widths."""
    if jnp.issubdtype(example.dtype, jnp.integer) and example.dtype.itemsize < 4:
        return example.astype(jnp.int32)
    return example
