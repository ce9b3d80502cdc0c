"""Table-batched pooled lookup (FBGEMM's TBE forward) as a Pallas kernel.

Every output bag ``s`` sums the rows of the positions ``[starts[s], ends[s])``
of one flat id buffer, so one launch serves every feature and table of a
stacked ``[R, D]`` buffer (ids already offset by their table's first row).
Each program owns ``block_rows`` bags and walks their ids in lock step:
one step loads one id per bag and gathers ``[block_rows, next_pow2(D)]``
values (surplus lanes and finished bags masked), accumulating in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .tiling import Tiling, check_bags, check_table, next_pow2, out_struct
from .triton_backend import pl_triton

DEFAULT_TILING = Tiling(block_rows=8, num_warps=4, num_stages=2)


def pooled_lookup_kernel(
    weights_ref,  # [R, D] table dtype
    rows_ref,  # [C] int32 stacked-buffer rows
    scale_ref,  # [C] float32 per-id multiplier (0 drops an id)
    starts_ref,  # [S] int32 first position of each bag
    ends_ref,  # [S] int32 one past the last position
    seg_ref,  # [C] int32 owning bag of each position, or None (no check)
    out_ref,  # [S, D] float32
    *,
    num_bags: int,
    num_rows: int,
    dim: int,
    block_bags: int,
    mean: bool,
):
    bags = pl.program_id(0) * block_bags + jnp.arange(block_bags, dtype=jnp.int32)
    bag_ok = bags < num_bags
    cols = jnp.arange(next_pow2(dim), dtype=jnp.int32)
    col_ok = cols < dim
    # Masked lanes keep their out-of-range indices: Triton never touches them and
    # the interpreter drops out-of-range stores. Clamping would alias a real
    # element and race with its store.
    start = pl_triton.load(starts_ref.at[bags], mask=bag_ok, other=0)
    length = pl_triton.load(ends_ref.at[bags], mask=bag_ok, other=0) - start
    length = jnp.maximum(length, 0)
    steps = jnp.max(length)

    def body(j, acc):
        live = bag_ok & (j < length)
        pos = jnp.where(live, start + j, 0)
        row = pl_triton.load(rows_ref.at[pos], mask=live, other=0)
        if seg_ref is not None:  # positions inside the range owned by another bag
            live = live & (pl_triton.load(seg_ref.at[pos], mask=live, other=-1) == bags)
        scale = pl_triton.load(scale_ref.at[pos], mask=live, other=0.0)
        row = jnp.clip(row, 0, num_rows - 1)  # as XLA's clamped gather; never out of bounds
        emb = pl_triton.load(
            weights_ref.at[row[:, None], cols[None, :]],
            mask=live[:, None] & col_ok[None, :],
            other=0.0,
        )
        return acc + emb.astype(jnp.float32) * scale[:, None]

    acc = jnp.zeros((block_bags, cols.shape[0]), jnp.float32)
    acc = jax.lax.fori_loop(0, steps, body, acc)
    if mean:
        acc = acc / jnp.maximum(length, 1).astype(jnp.float32)[:, None]
    pl_triton.store(
        out_ref.at[bags[:, None], cols[None, :]],
        acc,
        mask=bag_ok[:, None] & col_ok[None, :],
    )


@functools.partial(jax.jit, static_argnames=("mean", "tiling", "interpret"))
def pooled_lookup(
    weights: jax.Array,
    rows: jax.Array,
    starts: jax.Array,
    ends: jax.Array,
    scale: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    *,
    mean: bool = False,
    tiling: Tiling = DEFAULT_TILING,
    interpret: bool = False,
) -> jax.Array:
    """Pooled lookup of ``S`` bags over a stacked table, in one kernel launch.

    Args:
        weights: ``[R, D]`` float32/float16/bfloat16 (``D % 4 == 0``).
        rows: ``[C]`` int rows; out-of-range rows are clamped into ``[0, R)``
            (as XLA's gather), so callers mask invalid ids with ``scale = 0``.
        starts: ``[S]`` int32 first position of each bag in ``rows``.
        ends: ``[S]`` int32 one past each bag's last position (``ends <= starts``
            is an empty bag).
        scale: optional ``[C]`` float per-id multiplier (per-sample weights;
            0 drops an id).
        segment_ids: optional ``[C]`` owning bag of each position; when given,
            positions in a bag's range that belong to another bag are skipped
            (so ranges may overlap). Without it ranges must be exact.
        mean: divide each bag by ``ends - starts`` (MEAN pooling; empty bags 0).
        tiling: static launch parameters (``block_rows`` bags per program).
        interpret: run the kernel in the Pallas interpreter (any backend).

    Returns:
        ``[S, D]`` float32.

    Raises:
        NotImplementedError: ``D % 4 != 0``.

    Example:
        >>> w = jnp.arange(8.0).reshape(2, 4)
        >>> pooled_lookup(w, jnp.array([0, 1, 1]), jnp.array([0, 1]), jnp.array([1, 3]),
        ...               interpret=True).tolist()
        [[0.0, 1.0, 2.0, 3.0], [8.0, 10.0, 12.0, 14.0]]
    """
    dim = check_table(weights)
    c, s = rows.shape[0], starts.shape[0]
    scale, segment_ids = check_bags(rows, starts, ends, scale, segment_ids)
    if c == 0 or s == 0 or weights.shape[0] == 0:
        return jnp.zeros((s, dim), jnp.float32)
    block = tiling.block_rows
    kernel = functools.partial(
        pooled_lookup_kernel if segment_ids is not None else _no_seg(pooled_lookup_kernel),
        num_bags=s,
        num_rows=weights.shape[0],
        dim=dim,
        block_bags=block,
        mean=mean,
    )
    args = [weights, rows.astype(jnp.int32), scale, starts.astype(jnp.int32)]
    args += [ends.astype(jnp.int32)] + ([segment_ids] if segment_ids is not None else [])
    return pl.pallas_call(
        kernel,
        out_shape=out_struct((s, dim), jnp.float32, *args),
        grid=(pl.cdiv(s, block),),
        compiler_params=tiling.compiler_params(),
        interpret=interpret,
        name="jaxrec_pooled_lookup",
    )(*args)


def _no_seg(kernel):
    def wrapped(w, rows, scale, starts, ends, out, **kw):
        return kernel(w, rows, scale, starts, ends, None, out, **kw)

    return wrapped


def pooled_lookup_reference(
    weights, rows, starts, ends, scale=None, segment_ids=None, *, mean: bool = False
) -> jax.Array:
    """Pure-jnp :func:`pooled_lookup` (same arguments and clamping), the oracle of the tests."""
    c, s = rows.shape[0], starts.shape[0]
    pos = jnp.arange(c, dtype=jnp.int32)
    inside = (pos[None, :] >= starts[:, None]) & (pos[None, :] < ends[:, None])  # [S, C]
    if segment_ids is not None:
        inside = inside & (segment_ids[None, :] == jnp.arange(s)[:, None])
    scale = jnp.ones((c,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    emb = jnp.take(weights, rows, axis=0, mode="clip").astype(jnp.float32) * scale[:, None]
    # HIGHEST: a default-precision matmul is TF32 on Hopper (10-bit mantissa), too coarse
    # for an oracle (found on an H200).
    hi = jax.lax.Precision.HIGHEST
    out = (
        jnp.matmul(jnp.where(inside, 1.0, 0.0), emb, precision=hi)
        if c
        else jnp.zeros((s, weights.shape[1]))
    )
    if mean:
        out = out / jnp.maximum(ends - starts, 1).astype(jnp.float32)[:, None]
    return out.astype(jnp.float32)


def ranges_from_segments(segment_ids: jax.Array, num_segments: int) -> tuple[jax.Array, jax.Array]:
    """``(starts, ends)`` covering each segment's positions (``[0, 0)`` when empty).

    Ids ``>= num_segments`` (padding) belong to no segment. Pair with
    ``segment_ids=`` in :func:`pooled_lookup`, which skips foreign positions
    inside a range, so any segment order is exact (contiguous segments are fast).
    """
    c = segment_ids.shape[0]
    pos = jnp.arange(c, dtype=jnp.int32)
    seg = jnp.where(segment_ids < num_segments, segment_ids, num_segments)
    first = jax.ops.segment_min(pos, seg, num_segments=num_segments)
    last = jax.ops.segment_max(pos, seg, num_segments=num_segments)
    empty = last < first
    return jnp.where(empty, 0, first), jnp.where(empty, 0, last + 1)
