"""A dynamic table's hash index as C++ kernels: ``jaxrec_zch_train_step``, ``jaxrec_zch_remap``.

The host twins of ``jaxrec.modules.zch_index.train_step`` and ``remap``: the same
state, rows, evicted rows and counts bit for bit, from one pass over the ids, a
sort of the missed ones and a ranking of the ways of each bucket they land in
(``csrc/jaxrec_cpu/zch.h``), where XLA:CPU compiles several prefix sums, sorts
and scatters. The training kernel updates the state in place: its buffers are
aliased to the new state's, so a donated state is not copied.

This package sits below ``jaxrec.modules``: the layout comes as plain values
(:class:`ZchKernelLayout`) and the state as the seven arrays of ``ZchState``, in
its field order. Only for programs lowered for the CPU platform with the kernels
registered (:func:`ready`); ``zch_index`` chooses per lowering platform. Under
``jax.vmap`` each batch element is one call (``vmap_method="sequential"``). A
``jax.export`` artifact cannot hold these calls (custom calls without a
compatibility guarantee): export a program that runs the XLA path.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import loader

TRAIN_TARGET = "jaxrec_zch_train_step"
REMAP_TARGET = "jaxrec_zch_remap"
_POLICIES = {"lru": 0, "lfu": 1, "ttl": 2}
_ADMISSIONS = {"none": 0, "frequency": 1, "probability": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZchKernelLayout:
    """``zch_index.ZchLayout`` as the kernels' attributes (hashable, static).

    Args:
        slots, ways, total_buckets, bucket_offset, row_offset, seed: as ``ZchLayout``.
        policy: ``"lru"``, ``"lfu"`` or ``"ttl"`` (``single_ttl`` calls).
        admission: ``"none"``, ``"frequency"`` (``threshold`` sightings) or
            ``"probability"`` (hash low word below ``cutoff``; ``2**32`` admits all).
    """

    slots: int
    ways: int
    total_buckets: int
    bucket_offset: int = 0
    row_offset: int = 0
    seed: int = 0
    policy: Literal["lru", "lfu", "ttl"] = "lru"
    single_ttl: int = 0
    admission: Literal["none", "frequency", "probability"] = "none"
    threshold: int = 0
    cutoff: int = 2**32

    def __post_init__(self):
        if self.policy not in _POLICIES or self.admission not in _ADMISSIONS:
            raise ValueError(f"unknown policy {self.policy!r} or admission {self.admission!r}")
        if self.slots < self.ways or self.ways < 1 or self.slots % self.ways:
            raise ValueError(
                f"slots ({self.slots}) must be a positive multiple of ways ({self.ways})"
            )

    def attributes(self) -> dict:
        return dict(
            slots=np.int64(self.slots),
            ways=np.int64(self.ways),
            total_buckets=np.int64(self.total_buckets),
            bucket_offset=np.int64(self.bucket_offset),
            row_offset=np.int64(self.row_offset),
            seed=np.int64(self.seed),
        )


class ZchKernelStep(NamedTuple):
    """One training call's results (``zch_index.ZchStep`` as plain arrays)."""

    state: tuple  # the seven state arrays, in ZchState's field order (aliased to the inputs)
    rows: jax.Array  # [C] int32
    evicted: jax.Array  # [max_evictions] int32
    counts: jax.Array  # [3] int32: admitted, evicted, rejected


def ready(explicit: bool = False) -> bool:
    """Whether both kernels are registered (saying once why not)."""
    if loader.load() is not None:
        loader.warn_unavailable(explicit)
        return False
    if loader.has_target(TRAIN_TARGET) and loader.has_target(REMAP_TARGET):
        return True
    if not _STALE_WARNED:
        _STALE_WARNED.append(True)
        msg = (
            f"jaxrec's C++ extension has no {TRAIN_TARGET} (an older build): dynamic tables "
            "index with XLA on CPU (the same rows, slower to compile); rebuild it: pip install -e ."
        )
        if explicit:
            import warnings

            warnings.warn(msg, loader.CpuKernelWarning, stacklevel=3)
        else:
            loader.logger.warning(msg)
    return False


_STALE_WARNED: list = []


def _require(target: str) -> None:
    if not loader.has_target(target):
        why = loader.unavailable_reason() or "an older build of jaxrec.cpu"
        raise RuntimeError(f"{target} is not registered: {why}")


def _ids(lo, hi, valid) -> tuple[jax.Array, jax.Array, jax.Array]:
    if lo.ndim != 1 or hi.shape != lo.shape or valid.shape != lo.shape:
        raise ValueError(
            f"ids: lo, hi, valid must be [C], got {lo.shape=} {hi.shape=} {valid.shape=}"
        )
    return lo.astype(jnp.uint32), hi.astype(jnp.uint32), valid.astype(jnp.bool_)


def train_step_cpu(
    layout: ZchKernelLayout, state, lo, hi, valid, *, max_evictions: int
) -> ZchKernelStep:
    """``zch_index.train_step`` as the C++ kernel (``state``: the seven ``ZchState`` arrays).

    Args:
        layout: the static layout.
        state: ``(id_lo, id_hi, last_seen, counts, sketch, current_iter, occupancy)``:
            uint32 [S] x 2, int32 [S] x 2, int32 [S] (frequency admission) or [0],
            int32 [] x 2. Updated in place when donated.
        lo, hi: uint32 [C] id words; valid: bool [C].
        max_evictions: the evicted rows' length (static).
    """
    _require(TRAIN_TARGET)
    lo, hi, valid = _ids(lo, hi, valid)
    s, c = layout.slots, lo.shape[0]
    sketch = s if layout.admission == "frequency" else state[4].shape[0]
    want = ((s,), (s,), (s,), (s,), (sketch,), (), ())
    got = tuple(np.shape(x) for x in state)
    if len(state) != 7 or got != want:
        raise ValueError(f"train_step_cpu: state shapes {got}, want {want}")
    dtypes = (jnp.uint32, jnp.uint32) + (jnp.int32,) * 5
    outs = tuple(jax.ShapeDtypeStruct(shape, dt) for shape, dt in zip(want, dtypes, strict=True))
    i32 = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
    call = jax.ffi.ffi_call(
        TRAIN_TARGET,
        (*outs, i32(c), i32(max_evictions), i32(3)),
        input_output_aliases={k: k for k in range(7)},
        vmap_method="sequential",  # a batch of calls: one call per state and ids
    )
    res = call(
        *(x.astype(dt) for x, dt in zip(state, dtypes, strict=True)),
        lo,
        hi,
        valid,
        **layout.attributes(),
        policy=np.int64(_POLICIES[layout.policy]),
        single_ttl=np.int64(layout.single_ttl),
        admission=np.int64(_ADMISSIONS[layout.admission]),
        threshold=np.int64(layout.threshold),
        cutoff=np.int64(layout.cutoff),
    )
    return ZchKernelStep(tuple(res[:7]), *res[7:])


def remap_cpu(layout: ZchKernelLayout, id_lo, id_hi, last_seen, lo, hi, valid) -> jax.Array:
    """``zch_index.remap`` as the C++ kernel: ``[C]`` int32 rows of the ids held, FILL else."""
    _require(REMAP_TARGET)
    lo, hi, valid = _ids(lo, hi, valid)
    call = jax.ffi.ffi_call(
        REMAP_TARGET, jax.ShapeDtypeStruct(lo.shape, jnp.int32), vmap_method="sequential"
    )
    return call(
        id_lo.astype(jnp.uint32),
        id_hi.astype(jnp.uint32),
        last_seen.astype(jnp.int32),
        lo,
        hi,
        valid,
        **layout.attributes(),
    )
