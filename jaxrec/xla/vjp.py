"""Kernel forward, XLA backward: one ``custom_vjp`` for every backend's kernels.

A kernel (a Pallas call, a C++ FFI call) has no autodiff of its own. Its XLA
twin computes the same output in plain ``jnp`` and is the gradient oracle, so
the kernel's derivative is the twin's: ``jax.grad`` through a lookup gives the
same gradient whichever forward ran.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax


def with_xla_vjp(
    kernel: Callable,
    reference: Callable,
    *,
    nondiff_argnums: Sequence[int] = (),
    has_aux: bool = False,
) -> Callable:
    """``kernel``'s forward with ``reference``'s derivative.

    Args:
        kernel: ``kernel(*args)``, the kernel's output.
        reference: the XLA twin with the same arguments (``reference(*args)``);
            its ``jax.vjp`` is the backward.
        nondiff_argnums: positions of static, hashable arguments (sizes, flags,
            functions), passed to both and never differentiated.
        has_aux: ``kernel`` returns ``(out, aux)`` and ``reference`` only ``out``:
            ``aux`` (e.g. counts of bad ids) carries no gradient.

    Returns:
        A function of ``*args``: integer arguments get zero (``float0``)
        cotangents, float ones ``reference``'s.

    Example:
        >>> square = with_xla_vjp(lambda x: x * x, lambda x: x**2)
        >>> float(jax.grad(square)(3.0))
        6.0
    """
    nondiff = tuple(sorted(nondiff_argnums))

    def split(args):
        diff = tuple(a for i, a in enumerate(args) if i not in nondiff)
        return diff, tuple(args[i] for i in nondiff)

    def merge(diff, static):
        args, d, s = [], iter(diff), iter(static)
        for i in range(len(diff) + len(static)):
            args.append(next(s) if i in nondiff else next(d))
        return args

    @functools.partial(jax.custom_vjp, nondiff_argnums=nondiff)
    def fn(*args):
        return kernel(*args)

    def fwd(*args):
        return kernel(*args), split(args)[0]

    def bwd(*static_res_g):
        *static, diff, g = static_res_g
        _, vjp = jax.vjp(lambda *d: reference(*merge(d, static)), *diff)
        return vjp(g[0] if has_aux else g)

    fn.defvjp(fwd, bwd)
    return fn
