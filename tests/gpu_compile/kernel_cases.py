"""jaxrec's Pallas kernels, compiled deviceless for one H100 at production sizes.

Each function builds abstract inputs (nothing is allocated, so a 10M-row
table costs nothing) and compiles the kernel with ``interpret=False``: Pallas
-> Triton -> PTX -> ``ptxas`` for sm_90a. ``CASES`` picks coverage, not count:
every kernel, every dtype it takes, every optimizer inside the update kernel,
dims from 4 to 512 (20 is not a power of two: masked lanes), segments or not,
SUM and MEAN, and two tilings: each kernel's default and ``Tiling(16, 2)``
(more rows per program over fewer threads: the most registers per thread).
Sizes follow ``bench/gpu_lookup.py --preset target`` (8 tables of ~1M rows
stacked, batch 65,536, 20 ids per bag).

The Mosaic GPU lookup gets less (see mosaic_launch.py): Pallas -> Mosaic GPU
MLIR at lowering and XLA around it, but its PTX and ``ptxas`` run only on a
GPU, so its cases check the launch read from that MLIR (grid, block, shared
memory) instead of ``ptxas``'s spills.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from compile_runner import COMPILER_OPTIONS, Case, compile_abstract, lower_abstract
from mosaic_launch import mosaic_launches

from jaxrec import optim
from jaxrec.pallas import Tiling, fused_backward_update, sequence_lookup, sparse_update
from jaxrec.pallas import pooled_lookup as pallas_pooled_lookup
from jaxrec.pallas.mosaic_pooled import MosaicTiling, pooled_lookup_mosaic
from jaxrec.pallas.quant_lookup import quant_pooled_lookup
from jaxrec.xla.quantize import row_bytes

ROWS = 10_000_000  # stacked table rows
BAGS = 8 * 65_536  # features x batch
IDS = 20 * BAGS
# The update kernel is the same code at any number of ids; only XLA's sort in
# front of it grows (10M keys: ~3 CPU-s more per compile), so one optimizer
# compiles at IDS and the others at SORT_IDS.
SORT_IDS = 16_384
OPTIMIZERS = {  # every sparse optimizer of jaxrec.optim
    "sgd": lambda: optim.sgd(0.1),
    "adagrad": lambda: optim.adagrad(0.1),
    "rowwise_adagrad": lambda: optim.rowwise_adagrad(0.1),
    "adam": lambda: optim.adam(0.01),
    "partial_rowwise_adam": lambda: optim.partial_rowwise_adam(0.01),
    "lamb": lambda: optim.lamb(0.01),
    "partial_rowwise_lamb": lambda: optim.partial_rowwise_lamb(0.01),
    "lars_sgd": lambda: optim.lars_sgd(0.1),
}


def _s(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _tiling(block_rows, num_warps):
    return Tiling(block_rows=block_rows, num_warps=num_warps)


def pooled(*, dtype, dim, segments, mean, block_rows=8, num_warps=4):
    fn = functools.partial(pallas_pooled_lookup, mean=mean, tiling=_tiling(block_rows, num_warps))
    seg = _s((IDS,), "int32") if segments else None
    bags, ids = _s((BAGS,), "int32"), _s((IDS,), "int32")
    return compile_abstract(fn, _s((ROWS, dim), dtype), ids, bags, bags, _s((IDS,), "float32"), seg)


def pooled_mosaic(*, dtype, dim, segments, mean, **tiling):
    """The Mosaic GPU lookup lowered and compiled around; facts: its one launch."""
    fn = functools.partial(pooled_lookup_mosaic, mean=mean, tiling=MosaicTiling(**tiling))
    seg = _s((IDS,), "int32") if segments else None
    bags, ids = _s((BAGS,), "int32"), _s((IDS,), "int32")
    lowered = lower_abstract(
        fn, _s((ROWS, dim), dtype), ids, bags, bags, _s((IDS,), "float32"), seg
    )
    launches = mosaic_launches(lowered)
    if len(launches) != 1:
        raise AssertionError(f"expected one Mosaic GPU launch, found {launches}")
    launches[0].check()
    compiled = lowered.compile(compiler_options=COMPILER_OPTIONS)
    return compiled, {"launch": dataclasses.asdict(launches[0])}


def quant(*, dtype, dim, segments, mean, block_rows=8, num_warps=4):
    fn = functools.partial(
        quant_pooled_lookup, dim=dim, dtype=dtype, mean=mean, tiling=_tiling(block_rows, num_warps)
    )
    seg = _s((IDS,), "int32") if segments else None
    bags, ids = _s((BAGS,), "int32"), _s((IDS,), "int32")
    table = _s((ROWS, row_bytes(dim, dtype)), "uint8")
    return compile_abstract(fn, table, ids, bags, bags, _s((IDS,), "float32"), seg)


def sequence(*, dtype, dim, block_rows=16, num_warps=4):
    fn = functools.partial(sequence_lookup, tiling=_tiling(block_rows, num_warps))
    return compile_abstract(fn, _s((ROWS, dim), dtype), _s((IDS,), "int32"), _s((IDS,), "bool"))


def _table_and_state(opt, dtype, dim):
    return _s((ROWS, dim), dtype), jax.eval_shape(lambda: opt.init(ROWS, dim))


def fused_update(*, optimizer, dim, dtype="float32", block_rows=8, num_warps=4, ids=IDS):
    opt = OPTIMIZERS[optimizer]()
    fn = functools.partial(fused_backward_update, opt, tiling=_tiling(block_rows, num_warps))
    table, state = _table_and_state(opt, dtype, dim)
    occurrences = _s((ids,), "int32")
    out_grad = _s((BAGS, dim), "float32")
    return compile_abstract(
        fn,
        table,
        state,
        out_grad,
        occurrences,
        _s((ids,), "float32"),
        occurrences,
        _s((ids,), "bool"),
    )


def update(*, optimizer, dim, dtype="float32", state_rows=False):
    opt = OPTIMIZERS[optimizer]()
    fn = functools.partial(sparse_update, opt)
    table, state = _table_and_state(opt, dtype, dim)
    rows = _s((IDS,), "int32")  # unique rows, at most one per id
    grads = _s((IDS, dim), "float32")
    return compile_abstract(fn, table, state, rows, grads, rows if state_rows else None)


def _name(kind, dtype, dim, segments, mean, tiling):
    seg = "seg" if segments else "noseg"
    return f"{kind}-{dtype}-d{dim}-{seg}-{'mean' if mean else 'sum'}-t{tiling[0]}w{tiling[1]}"


def _pooled(dtype, dim, segments, mean, tiling=(8, 4), **case):
    kw = dict(dtype=dtype, dim=dim, segments=segments, mean=mean)
    kw |= dict(block_rows=tiling[0], num_warps=tiling[1])
    name = _name("pooled", dtype, dim, segments, mean, tiling)
    return Case(name=name, target="kernel_cases:pooled", kwargs=kw, **case)


def _quant(dtype, dim, segments, mean, tiling=(8, 4), **case):
    kw = dict(dtype=dtype, dim=dim, segments=segments, mean=mean)
    kw |= dict(block_rows=tiling[0], num_warps=tiling[1])
    name = _name("quant", dtype, dim, segments, mean, tiling)
    return Case(name=name, target="kernel_cases:quant", kwargs=kw, **case)


def _mosaic(dtype, dim, segments, mean, **tiling):
    t = MosaicTiling(**tiling)
    kw = dict(dtype=dtype, dim=dim, segments=segments, mean=mean) | tiling
    name = f"mosaic-{dtype}-d{dim}-{'seg' if segments else 'noseg'}-{'mean' if mean else 'sum'}"
    name += f"-b{t.block_bags}s{t.num_stages}" + ("-manual" if t.manual_barriers else "")
    return Case(name=name, target="kernel_cases:pooled_mosaic", kwargs=kw)


def _sequence(dtype, dim, tiling=(16, 4)):
    kw = dict(dtype=dtype, dim=dim, block_rows=tiling[0], num_warps=tiling[1])
    name = f"sequence-{dtype}-d{dim}-t{tiling[0]}w{tiling[1]}"
    return Case(name=name, target="kernel_cases:sequence", kwargs=kw)


def _fused(optimizer, dim=128, dtype="float32", tiling=(8, 4), ids=SORT_IDS, **case):
    kw = dict(optimizer=optimizer, dim=dim, dtype=dtype, ids=ids)
    kw |= dict(block_rows=tiling[0], num_warps=tiling[1])
    name = f"fused-{optimizer}-{dtype}-d{dim}-t{tiling[0]}w{tiling[1]}-ids{ids}"
    return Case(name=name, target="kernel_cases:fused_update", kwargs=kw, **case)


def _sparse(optimizer, dim, dtype="float32", state_rows=False):
    kw = dict(optimizer=optimizer, dim=dim, dtype=dtype, state_rows=state_rows)
    name = f"sparse-{optimizer}-{dtype}-d{dim}" + ("-state_rows" if state_rows else "")
    return Case(name=name, target="kernel_cases:update", kwargs=kw)


# Spills measured with ptxas 13.0 for sm_90a (bytes stored to local memory per
# case): every case at its kernel's default tiling spills nothing, at D=512
# even for LAMB, the heaviest row update. Tiling(16, 2) puts 16 rows x 512
# lanes on 64 threads (128 float32 accumulators per thread, plus 64-bit row
# pointers once a table passes 4 GiB), past the 255 registers a thread has:
# the pooled fp32 lookup spills 36 bytes (under SPILL_LIMIT), the two cases
# below more. They are tuning points of bench/gpu_lookup.py's sweep, not
# defaults, so they get allowances of ~1.5x what they spill today; a kernel
# change that spills more still fails. (At Tiling(16, 2), D=512, SGD's update
# spills 112 bytes, Adam's 3 KiB, LAMB's 16 KiB; harness_cases.py checks that
# a 5 KiB spill fails.)
INT4_MEAN_512_SPILLS = 1024  # measured 736-748 bytes (MEAN keeps the lengths live)
ROWWISE_ADAGRAD_512_SPILLS = 512  # measured 288-304 bytes
CASES = (
    # pooled lookup: each dtype with and without segments, SUM and MEAN, D from
    # 4 to 512, tables under 4 GiB (32-bit offsets) and over (64-bit)
    _pooled("float32", 128, False, False),
    _pooled("float32", 128, True, True, (16, 2)),
    _pooled("float32", 20, True, False),
    _pooled("float32", 4, False, True),
    _pooled("float32", 512, True, False, (16, 2)),
    _pooled("float16", 128, True, False),
    _pooled("float16", 20, False, True, (16, 2)),
    _pooled("bfloat16", 64, False, False, (16, 2)),
    _pooled("bfloat16", 512, True, True),
    # the Mosaic GPU pooled lookup: its default tiling (8 bags a program: 65,536
    # programs, over the 65,535 a grid's y may hold), 32 bags (the most unrolled
    # code), 4 stages, the most shared memory
    _mosaic("float32", 128, True, False),
    _mosaic("bfloat16", 512, False, True, block_bags=32, num_stages=1),
    _mosaic("float16", 64, True, True, num_stages=4, manual_barriers=True),
    _mosaic("float32", 512, False, False, block_bags=16, num_stages=3),
    # sequence lookup
    _sequence("float32", 128),
    _sequence("bfloat16", 20),
    _sequence("float32", 512, (16, 2)),
    # fused backward + update: every optimizer at D=128 (fp32 table; row-wise
    # Adagrad, DLRM's, with the full-size sort), then D=512, a bf16 table with
    # a non-power-of-two dim, and the second tiling
    *(_fused(o, ids=IDS if o == "rowwise_adagrad" else SORT_IDS) for o in OPTIMIZERS),
    _fused("lamb", dim=512),
    _fused("partial_rowwise_lamb", dim=20, dtype="bfloat16"),
    _fused("rowwise_adagrad", dim=512, tiling=(16, 2), max_spill_bytes=ROWWISE_ADAGRAD_512_SPILLS),
    # sparse update (rows already unique), with and without separate state rows
    _sparse("rowwise_adagrad", 128),
    _sparse("adam", 20, "bfloat16", state_rows=True),
    # quantized lookup (INT8/INT4 TBE rows)
    _quant("int8", 128, True, False),
    _quant("int8", 20, False, True, (16, 2)),
    _quant("int8", 512, True, False, (16, 2)),
    _quant("int4", 128, True, True),
    _quant("int4", 20, False, False),
    _quant("int4", 512, True, False),
    _quant("int4", 512, True, True, (16, 2), max_spill_bytes=INT4_MEAN_512_SPILLS),
)
