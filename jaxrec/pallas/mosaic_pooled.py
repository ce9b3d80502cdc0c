"""Table-batched pooled lookup on Mosaic GPU (Hopper, ``sm_90``+): :func:`pooled_lookup`'s twin.

Same contract and results as :func:`jaxrec.pallas.pooled.pooled_lookup` (the
Triton kernel): every output bag ``s`` sums the rows of positions
``[starts[s], ends[s])`` of one flat id buffer over a stacked ``[R, D]`` table,
in float32, with per-id scales, MEAN, ``segment_ids`` and clamped rows.

**Schedule.** A program (one CTA of one warpgroup, 128 threads) owns
``block_bags = B`` bags and ``block_cols = Dc`` columns. Its accumulator is a
``[64, Dc]`` float32 array in the WGMMA register layout (64 rows is that
layout's height), whose row ``r = p * B + b`` holds bag ``b``'s positions
``p, p + P, p + 2P, ...`` with ``P = 64 // B``. Step ``j`` gathers, for every
row ``r``, the table row of position ``starts[b] + j * P + p``:

1. *issue* (scalar code, every thread alike): read the id, its scale and (with
   ``segment_ids``) its owner; if the position is live, start a bulk async
   copy (``cp.async.bulk``, the descriptor-free TMA path of
   ``copy_gmem_to_smem``) of that row's ``Dc`` values into row ``r`` of a
   shared-memory tile, counted on the stage's mbarrier; if not, only arrive on
   the barrier (every row arrives once per step, so the barrier needs no
   dynamic count). The scale goes into row ``r`` of a ``[64]`` register vector.
2. *accumulate*: wait on the barrier, load the ``[64, Dc]`` tile into
   registers and add ``tile * scale[:, None]``, masked where the scale is 0
   (rows that were not copied hold stale data).

The issue of step ``j + num_stages - 1`` runs before the accumulation of step
``j`` (``num_stages`` tiles in flight). The program runs ``ceil(longest bag /
P)`` steps; the ``P`` partial rows of each bag are summed through shared
memory at the end and the ``[B, Dc]`` block leaves by one TMA store. The
output is ``[ceil(S / B) * B, D]``, cut to ``[S, D]`` when ``S % B``.

**Limits.** A copy moves whole 128-byte multiples (the Lane-level
``copy_gmem_to_smem`` splits its byte count over 128 threads), so ``D *
itemsize % 128 == 0``: ``D % 32 == 0`` for float32, ``D % 64 == 0`` for
16-bit tables. Other dims raise ``NotImplementedError`` (the dispatcher then
falls back). The kernel is written in the Lane lowering semantics, pinned
explicitly (JAX 0.11 changed ``CompilerParams``' default to Warpgroup).

**What would make it faster** (guesses until timed on a GPU, ``bench/``):
more warps per SM (one warpgroup per CTA and ~100 KB of shared memory at the
defaults: 8 warps per SM for a latency-bound gather; the output buffer could
alias a stage through ``plgpu.RefUnion``); splitting the issue over the 4
warps (warp-level code, 16 rows each) instead of every thread running all 64
rows' scalar code, whose id load -> copy chains are branchy and serial; a
producer warpgroup feeding a consumer one (``emit_pipeline_warp_specialized``);
one copy of a step's ids and scales when the bags are contiguous (the CSR
case) instead of scalar loads; ``manual_barriers=True``; on Blackwell, TMA
gathers (4 rows per instruction).

**Verified** on CPU only: in Pallas's Mosaic GPU interpreter (which simulates
the copies, barriers and shared memory and detects races) against
``pooled_lookup_reference``, lowered for CUDA, and compiled deviceless for an
H100, which stops short of PTX (see ``tests/gpu_compile/mosaic_launch.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..xla.lookup import embedding_bag_xla
from ..xla.vjp import with_xla_vjp
from .pooled import ranges_from_segments
from .tiling import check_bags, check_table

ROWS = 64  # rows of the WGMMA register layout: one warpgroup's accumulator height
COPY_BYTES = 128  # a Lane-level copy_gmem_to_smem moves a multiple of this (one byte per thread)
SMEM_BYTES = 227 * 1024  # shared memory one Hopper CTA may allocate
MAX_DEFAULT_COLS = 128  # widest column block picked by default (64 float32 registers/thread)
_ROW_PAD_BYTES = 16  # tile row padding: rows 16 B apart fall in different banks
_LOAD_HAS_IDX = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTiling:
    """Static launch parameters of :func:`pooled_lookup_mosaic`.

    Attributes:
        block_bags: bags per program: 8, 16 or 32; each step gathers ``64 //
            block_bags`` positions of each (fewer bags: less lock-step waste on
            ragged bags, more on one-id bags). The issue code is unrolled over
            the bags and keeps 2 scalars per bag live, so 32 costs registers.
        block_cols: columns per program (``None``: the widest divisor of ``D``
            of at most 128 whose rows are whole 128-byte copies).
        num_stages: tiles in flight (shared memory: ``num_stages * 64 *
            block_cols`` table values plus a ``[64, block_cols]`` float32 buffer;
            the default, 2 stages of 128 float32 columns, is ~100 KB: two CTAs
            per SM).
        manual_barriers: one warpgroup barrier per step instead of Mosaic's
            automatic barrier before every copy and around every shared-memory
            store (``CompilerParams(unsafe_no_auto_barriers=True)``).

    The defaults are guesses: nothing has been timed on a GPU yet.
    """

    block_bags: int = 8
    block_cols: int | None = None
    num_stages: int = 2
    manual_barriers: bool = False

    def __post_init__(self):
        if self.block_bags not in (8, 16, 32):
            raise ValueError(f"block_bags must be 8, 16 or 32, got {self.block_bags}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be at least 1, got {self.num_stages}")
        if self.block_cols is not None and self.block_cols < 1:
            raise ValueError(f"block_cols must be positive, got {self.block_cols}")


DEFAULT_MOSAIC_TILING = MosaicTiling()


def pooled_lookup_mosaic_kernel(
    weights_ref,  # [R, D] table dtype (GMEM)
    rows_ref,  # [C] int32 stacked-buffer rows
    scale_ref,  # [C] float32 per-id multiplier (0 drops an id)
    starts_ref,  # [S_pad] int32 first position of each bag (0 past S)
    ends_ref,  # [S_pad] int32 one past the last position (0 past S)
    seg_ref,  # [C] int32 owning bag of each position, or None (no check)
    out_ref,  # [S_pad, D] float32
    tile_ref,  # SMEM [num_stages, 64, Dc + pad] table dtype: gathered rows
    acc_ref,  # SMEM [64, Dc] float32: the partial sums on their way out
    barriers,  # num_stages barriers, 64 arrivals each (one per tile row)
    *,
    num_rows: int,
    num_ids: int,
    block_bags: int,
    block_cols: int,
    num_stages: int,
    mean: bool,
    manual_barriers: bool,
    interpret: bool,
):
    b_, dc, stages = block_bags, block_cols, num_stages
    per_bag = ROWS // b_  # positions of one bag per step
    first_bag = lax.axis_index("bags") * b_
    c0 = lax.axis_index("cols") * dc
    # Layout casts only steer the lowering; the interpreter has no rule for them.
    cast = (lambda x, _: x) if interpret else plgpu.layout_cast
    vec_layout = plgpu.Layout.WGMMA.reduce(1)  # [64]: one value per accumulator row
    iota = cast(lax.broadcasted_iota(jnp.int32, (ROWS,), 0), vec_layout)
    zeros = cast(jnp.zeros((ROWS,), jnp.float32), vec_layout)

    def per_row(values):  # [64] vector whose row r holds values[r % B]
        out = zeros
        for r in range(ROWS):
            out = jnp.where(iota == r, values[r % b_], out)
        return out

    # Each bag's live positions [lo, lo + n), clipped to the buffer: 2 * B scalars live
    # through the kernel (registers: one reason to keep block_bags small).
    lo, n = [], []
    for b in range(b_):
        start, end = starts_ref[first_bag + b], ends_ref[first_bag + b]
        lo.append(jnp.maximum(start, 0))
        n.append(jnp.maximum(jnp.minimum(end, num_ids) - lo[-1], 0))
    steps = (functools.reduce(jnp.maximum, n) + per_bag - 1) // per_bag

    def issue(j):
        """Starts step ``j``'s copies into its stage; returns the step's ``[64]`` scales."""
        slot = j % stages
        bar = barriers.at[slot]

        def skip():
            plgpu.barrier_arrive(bar)
            return jnp.float32(0.0)

        def owned_by(bag, pos, then):
            return lambda: lax.cond(seg_ref[pos] == bag, then, skip)

        def position(p, scales):  # row p * B + b gathers position j * P + p of bag b
            t = j * per_bag + p
            for b in range(b_):
                r, pos = p * b_ + b, lo[b] + t

                def gather(pos=pos, r=r):
                    scale = scale_ref[pos]
                    row = jnp.clip(rows_ref[pos], 0, num_rows - 1)  # as XLA's clamped gather

                    def copy():
                        plgpu.copy_gmem_to_smem(
                            weights_ref.at[pl.ds(row, 1), pl.ds(c0, dc)],
                            tile_ref.at[slot, pl.ds(r, 1), pl.ds(0, dc)],
                            bar,
                            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,  # rows are clamped
                        )
                        return scale

                    return lax.cond(scale != 0, copy, skip)  # a dropped id costs no copy

                fetch = gather
                if seg_ref is not None:  # skip positions in the range owned by another bag
                    fetch = owned_by(first_bag + b, pos, gather)
                scale = lax.cond(t < n[b], fetch, skip)
                scales = jnp.where(iota == r, scale, scales)
            return scales

        return lax.fori_loop(0, per_bag, position, zeros)

    def accumulate(j, scales, acc):
        slot = j % stages
        plgpu.barrier_wait(barriers.at[slot])
        tile = tile_ref.at[slot, :, pl.ds(0, dc)]
        if interpret:
            x = tile[...]
        elif _LOAD_HAS_IDX:  # JAX 0.10: idx is positional; 0.11 deprecates it
            x = plgpu.load(tile, (), layout=plgpu.Layout.WGMMA, optimized=False)
        else:  # JAX 0.11 drops idx; the type checker sees 0.10's signature
            x = plgpu.load(tile, layout=plgpu.Layout.WGMMA, optimized=False)  # pyright: ignore[reportCallIssue]
        # optimized=False: rows land at data-dependent times, so the tile is not swizzled
        # and Mosaic cannot prove a conflict-free pattern (the padding avoids conflicts).
        s = lax.broadcast_in_dim(scales, (ROWS, dc), (0,))
        return acc + jnp.where(s != 0, x.astype(jnp.float32) * s, 0.0)

    def step(i, carry):  # issues step i, accumulates step i - (stages - 1)
        acc, queued = carry
        if manual_barriers:
            plgpu.commit_smem()  # every thread is done reading the stage refilled below
        # Steps past the last issue nothing: every barrier phase gets awaited.
        queued = (*queued, lax.cond(i < steps, lambda: issue(i), lambda: zeros))
        done = i - (stages - 1)
        acc = lax.cond(done >= 0, lambda: accumulate(done, queued[0], acc), lambda: acc)
        return acc, queued[1:]

    acc = cast(jnp.zeros((ROWS, dc), jnp.float32), plgpu.Layout.WGMMA)
    acc, _ = lax.fori_loop(0, steps + stages - 1, step, (acc, (zeros,) * (stages - 1)))
    if mean:  # divide by ends - starts, as the reference (not by the live count)
        divisor = [
            jnp.maximum(ends_ref[first_bag + b] - starts_ref[first_bag + b], 1).astype(jnp.float32)
            for b in range(b_)
        ]
        acc = acc / lax.broadcast_in_dim(per_row(divisor), (ROWS, dc), (0,))
    acc_ref[...] = acc
    # Sum each bag's per_bag partial rows ([B, Dc] slices, read in a strided layout).
    if manual_barriers:
        plgpu.commit_smem()
    parts = [acc_ref.at[pl.ds(p * b_, b_)][...] for p in range(per_bag)]
    if manual_barriers:
        plgpu.commit_smem()
    acc_ref.at[pl.ds(0, b_)][...] = functools.reduce(jnp.add, parts)
    plgpu.commit_smem()  # a fence for the TMA engine, then a warpgroup barrier
    plgpu.copy_smem_to_gmem(
        acc_ref.at[pl.ds(0, b_)], out_ref.at[pl.ds(first_bag, b_), pl.ds(c0, dc)]
    )
    plgpu.wait_smem_to_gmem(0)


def block_cols_for(weights: jax.Array, tiling: MosaicTiling = DEFAULT_MOSAIC_TILING) -> int:
    """The column block ``tiling`` gives ``weights``; raises where Mosaic cannot take ``D``.

    Raises:
        NotImplementedError: a row of ``D`` values is not a multiple of 128 bytes.
        ValueError: ``tiling.block_cols`` does not divide ``D`` into 128-byte
            multiples, or the tiles overflow shared memory.
    """
    dim, size = weights.shape[1], weights.dtype.itemsize
    unit = COPY_BYTES // size  # values per 128 bytes
    if dim % unit:
        raise NotImplementedError(
            f"the Mosaic GPU lookup copies rows in 128-byte multiples, so a {weights.dtype} "
            f"table needs dim % {unit} == 0; got weights.shape={weights.shape} (use the "
            "Triton kernel or XLA)"
        )
    cols = tiling.block_cols
    if cols is None:
        cols = max(c for c in range(unit, min(dim, MAX_DEFAULT_COLS) + 1, unit) if dim % c == 0)
    elif dim % cols or cols % unit or cols > 256:
        raise ValueError(
            f"block_cols={cols} must divide dim={dim}, be a multiple of {unit} "
            f"({weights.dtype}: 128 bytes) and at most 256"
        )
    smem = tiling.num_stages * ROWS * (cols * size + _ROW_PAD_BYTES) + ROWS * cols * 4
    if smem > SMEM_BYTES:
        raise ValueError(
            f"{tiling} with block_cols={cols} needs {smem} bytes of shared memory, over "
            f"{SMEM_BYTES}: use fewer stages or narrower blocks"
        )
    return cols


def _interpret_params(interpret):
    """``interpret`` as ``plgpu.kernel`` takes it: False -> None, True -> default params."""
    if not isinstance(interpret, bool):
        return interpret  # an InterpretGPUParams (e.g. detect_races=True)
    if not interpret:
        return None
    # Private in JAX 0.10.2 and 0.11 (public as plgpu.InterpretGPUParams after 0.11).
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


@functools.partial(jax.jit, static_argnames=("mean", "tiling", "interpret"))
def pooled_lookup_mosaic(
    weights: jax.Array,
    rows: jax.Array,
    starts: jax.Array,
    ends: jax.Array,
    scale: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    *,
    mean: bool = False,
    tiling: MosaicTiling = DEFAULT_MOSAIC_TILING,
    interpret: Any = False,
) -> jax.Array:
    """Pooled lookup of ``S`` bags over a stacked table, as one Mosaic GPU kernel.

    Arguments and results as :func:`jaxrec.pallas.pooled_lookup` (the Triton
    kernel), with a :class:`MosaicTiling`.

    Args:
        weights: ``[R, D]`` float32/float16/bfloat16, rows of a multiple of 128
            bytes (``D % 32 == 0`` for float32, ``D % 64 == 0`` for 16-bit).
        rows: ``[C]`` int rows; out-of-range rows are clamped into ``[0, R)``.
        starts: ``[S]`` int32 first position of each bag in ``rows``.
        ends: ``[S]`` int32 one past each bag's last position (``ends <= starts``
            is an empty bag); positions outside ``[0, C)`` are skipped.
        scale: optional ``[C]`` float per-id multiplier (0 drops an id).
        segment_ids: optional ``[C]`` owning bag of each position; positions in
            a bag's range owned by another bag are skipped.
        mean: divide each bag by ``ends - starts`` (MEAN; empty bags 0).
        tiling: static launch parameters.
        interpret: run in Pallas's Mosaic GPU interpreter (CPU; slow: tests); True
            or an ``InterpretGPUParams`` (e.g. ``detect_races=True``).

    Returns:
        ``[S, D]`` float32.

    Raises:
        NotImplementedError: ``D`` that Mosaic cannot copy (see ``block_cols_for``).

    Example:
        >>> w = jnp.arange(64.0).reshape(2, 32)
        >>> out = pooled_lookup_mosaic(w, jnp.array([0, 1, 1]), jnp.array([0, 1]),
        ...                            jnp.array([1, 3]), interpret=True)
        >>> out[:, :2].tolist()
        [[0.0, 1.0], [64.0, 66.0]]
    """
    dim = check_table(weights)
    c, s = rows.shape[0], starts.shape[0]
    scale, segment_ids = check_bags(rows, starts, ends, scale, segment_ids)
    cols = block_cols_for(weights, tiling)
    if c == 0 or s == 0 or weights.shape[0] == 0:
        return jnp.zeros((s, dim), jnp.float32)
    bags = tiling.block_bags
    padded = pl.cdiv(s, bags) * bags
    pad = lambda x: jnp.pad(x.astype(jnp.int32), (0, padded - s))  # padding bags are empty
    kernel = functools.partial(
        pooled_lookup_mosaic_kernel if segment_ids is not None else _no_seg,
        num_rows=weights.shape[0],
        num_ids=c,
        block_bags=bags,
        block_cols=cols,
        num_stages=tiling.num_stages,
        mean=mean,
        manual_barriers=tiling.manual_barriers,
        interpret=_interpret_params(interpret) is not None,
    )
    pad_cols = _ROW_PAD_BYTES // weights.dtype.itemsize
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((padded, dim), jnp.float32),
        # Mosaic reverses the grid into CUDA's (x, y, z): bags go to x (2^31 - 1
        # blocks), columns to y (at most 65,535).
        grid=(dim // cols, padded // bags),
        grid_names=("cols", "bags"),
        scratch_types=[
            plgpu.SMEM((tiling.num_stages, ROWS, cols + pad_cols), weights.dtype),
            plgpu.SMEM((ROWS, cols), jnp.float32),
            plgpu.Barrier(num_arrivals=ROWS, num_barriers=tiling.num_stages),
        ],
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane,
            unsafe_no_auto_barriers=tiling.manual_barriers,
        ),
        kernel_name="jaxrec_pooled_lookup_mosaic",
        interpret=_interpret_params(interpret),
    )
    args = [weights, rows.astype(jnp.int32), scale, pad(starts), pad(ends)]
    out = call(*args, *([segment_ids] if segment_ids is not None else []))
    return out if padded == s else out[:s]


def _no_seg(w, rows, scale, starts, ends, out, *scratch, **kw):
    return pooled_lookup_mosaic_kernel(w, rows, scale, starts, ends, None, out, *scratch, **kw)


def _bag_kernel(weights, rows, segment_ids, num_segments, scale, interpret, tiling):
    starts, ends = ranges_from_segments(segment_ids, num_segments)
    scale = jnp.where(segment_ids < num_segments, scale.astype(jnp.float32), 0.0)
    return pooled_lookup_mosaic(
        weights, rows, starts, ends, scale, segment_ids, tiling=tiling, interpret=interpret
    )


def _bag_xla(weights, rows, segment_ids, num_segments, scale, interpret, tiling):
    del interpret, tiling
    return embedding_bag_xla(weights, rows, segment_ids, num_segments, scale)


_bag = with_xla_vjp(_bag_kernel, _bag_xla, nondiff_argnums=(3, 5, 6))


def embedding_bag_mosaic(
    weights,
    rows,
    segment_ids,
    num_segments,
    per_value_scale=None,
    *,
    interpret,
    tiling: MosaicTiling = DEFAULT_MOSAIC_TILING,
):
    """``jaxrec.ops.embedding_bag`` on :func:`pooled_lookup_mosaic` (as ``embedding_bag_pallas``).

    Raises ``NotImplementedError`` (at trace time) for tables the kernel cannot
    take, so the dispatcher falls back; ``jax.grad`` goes through XLA's path.
    """
    check_table(weights)  # raise before tracing under custom_vjp
    block_cols_for(weights, tiling)
    scale = jnp.ones(rows.shape, jnp.float32) if per_value_scale is None else per_value_scale
    return _bag(
        weights, rows, segment_ids.astype(jnp.int32), num_segments, scale, interpret, tiling
    )
