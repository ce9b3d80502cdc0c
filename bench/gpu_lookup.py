"""GPU lookup benchmark: forward and fused backward + update, Pallas vs XLA vs torch.

For each workload (FBGEMM's ``T, E, D, B, L, alpha, weighted, dtype``; the
``T`` tables are stacked in one buffer, one feature each) it times, in the
same process run:

* ``fwd``: the table-batched pooled lookup: jaxrec's Pallas kernel
  (``jaxrec.pallas.pooled_lookup``, one launch), the Mosaic GPU kernel
  (``mosaic``: ``embedding_bag(..., implementation="mosaic_gpu")``; sm_90+ and
  rows of a multiple of 128 bytes, a ``skipped`` line otherwise), jaxrec's XLA
  path (``jaxrec.ops.embedding_bag``) and ``torch.nn.EmbeddingBag`` over the
  same stacked table (CUDA only);
* ``bwd_update``: from the output gradient to updated rows and optimizer
  state, exact (duplicates summed), tables and state donated, for each
  ``--optimizer``: the Pallas ``fused_backward_update`` (``pallas``, its default
  schedule), the same kernel with ``piece_len=None`` where it takes that keyword
  (``pallas_per_run``: one program walks a whole run of duplicates, the schedule
  before load balancing; a ``skipped`` line otherwise), the XLA path (per-id
  grads, ``dedup_rows``, ``apply_rows``) and torch (``EmbeddingBag(sparse=True)``
  backward plus its closest sparse optimizer, see ``TORCH_OPTIMIZERS``; CUDA only);
* ``seq``: the sequence (unpooled) lookup, ``[B*T*L, D]`` rows out: the Pallas
  ``sequence_lookup`` vs XLA's gather (``jaxrec.ops.embedding_gather``);
* ``copy``: a device-to-device copy (``x + 1`` over 1 GiB, read + write), the
  bandwidth ceiling of this run (64 MiB off GPU).

**Bytes.** Each timed line has ``modelled_bytes``, the bytes the op must move
between HBM and the chip with every row it touches read once (repeats served
from cache), ``gbps`` on them and ``fraction_of_copy`` (``gbps`` over the
copy's). With ``C = B*T*L`` ids, ``S = T*B`` bags, ``U`` unique rows in the
batch (counted on the host), ``e`` bytes per table element and ``s`` bytes of
optimizer state per row:

* ``fwd``: ids ``4C`` + bag offsets ``4(S+1)`` (+ weights ``4C``) + rows
  ``U*D*e`` + float32 output ``4*S*D``;
* ``seq``: ids ``4C`` + valid flags ``C`` + rows ``U*D*e`` + output ``C*D*e``;
* ``bwd_update``: output gradient ``4*S*D`` + ids, segments and scales ``12C``
  + valid flags ``C`` + each unique row's table row and state, read and
  written, ``2U(D*e + s)``. Sorting ids is the implementation's overhead, not
  counted.

Beside them, FBGEMM's per-id count, as this bench reported before
(``per_id_bytes``, ``per_id_gbps``, ``per_id_fraction_of_copy``; the ``bytes``,
``gbps`` and ``fraction_of_copy`` of older results, e.g.
``bench/results/gpu_check_nvidia_h200_2026-11-26*``, are these):
forward ``B*T*L*D*e``, seq twice that, backward + update
``B*T*L*(4*D + 2*D*e + 2*s)``. Where ids repeat, per-id figures can exceed
the copy ceiling (rows served from L2); the modelled ones should not. Lines
also carry ``ids``, ``unique_rows``, ``bags`` and ``max_dups`` (the most
occurrences of one row).

**Checks.** Every implementation is compared with a float64 result computed on
the host (``bench/exact.py``, ``bench/lookup_checks.py``) from the same inputs,
on up to ``--check`` (default 16,384) bags at random and as many unique rows:
the most repeated half of them (while their ids number at most 2**20) and a
random sample of the rest; for the update, the table and every state field
after one step. Each result has two bounds on float32 rounding, valid for any
order of summation: the worst case (Higham's ``gamma(n-1) * sum|terms|`` per
sum of ``n`` terms, carried through the optimizer's update), and a
probabilistic one (``8 * sqrt(n-1) * u * sum|terms|``, Higham and Mary 2019),
which still says something for rows repeated 10^5 times, where the worst case
exceeds the sum itself. ``check`` lines give per implementation and quantity
``max_abs_err``, ``max_bound``, ``err_over_bound``, ``outside_bound``,
``unbounded_bound`` (bounds made infinite by a divisor within its error of
zero) and ``within_bound``, and the same for ``prob_bound``; an ``agree`` line
per pass (and optimizer) has ``agree`` (Pallas's default schedule within the
worst-case bound), each implementation's ``within_bound`` and
``within_prob_bound``, and ``ok`` (every JAX implementation within the
worst-case bound). The sequence lookup must be exact. The run exits 1 unless
every ``ok``: an error outside the worst-case bound is not rounding.

**Tables** are drawn on the device (``jaxrec.ops.init.uniform_rows``; ``table_init``
and ``table_init_s`` in the lines) once per shape: each update is undone after
it is timed (its touched rows written back), so every implementation, optimizer
and workload of that shape starts from the same values. Presets: the tiny ones
(CI), ``target`` / ``target_zipf`` (T=8, E=1M, D=128, B=65,536, L=20; uniform and
Zipf 1.15), ``gpu_sweep`` around it, and HBM-bound sizes (tables 400-1000x the
L2; memory arithmetic by ``_HBM``): ``hbm`` (T=4, E=10M, uniform and Zipf 0.8 /
1.05 / 1.2, every optimizer fits), ``hbm_check`` (its uniform, 1.05 and 1.2, for
``bench/gpu_check.sh``), ``hbm_large`` (T=2, E=50M; Adam does not fit, skipped).

Off GPU the Pallas kernels run in the Pallas interpreter (``interpret: true``
in the records): only the tiny presets make sense there, as a test. On the
GPU machine::

    python bench/gpu_lookup.py --preset target,target_zipf --reps 20
    python bench/gpu_lookup.py --preset hbm --impl pallas,pallas_per_run,xla \
        --pass fwd,bwd_update --optimizer sgd,rowwise_adagrad,adam --reps 10
    python bench/gpu_lookup.py --preset gpu_sweep --reps 10 > bench/results/gpu_lookup_h200.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import lookup_checks
import numpy as np
from common import add_spec_args, add_timing_args, record, time_ms  # noqa: E402
from lookup_checks import HostBatch, host_batch
from specs import PRESETS, LookupSpec, make_inputs  # noqa: E402

from jaxrec import optim
from jaxrec.ops import embedding_bag, embedding_gather
from jaxrec.ops.init import TablePiece, uniform_rows
from jaxrec.pallas import fused_backward_update, pooled_lookup, sequence_lookup
from jaxrec.xla.backward import dedup_rows

BENCH = "gpu_lookup"
IMPLS = ("pallas", "pallas_per_run", "mosaic", "xla", "torch")
JAX_IMPLS = ("pallas", "pallas_per_run", "mosaic", "xla")
PASSES = ("fwd", "bwd_update", "seq")
JAX_DTYPES = {"fp32": jnp.float32, "fp16": jnp.float16, "bf16": jnp.bfloat16}
OPTIMIZERS: dict[str, Callable[[], optim.SparseOptimizer]] = {
    "sgd": lambda: optim.sgd(0.01),
    "rowwise_adagrad": lambda: optim.rowwise_adagrad(0.01, eps=1e-8),
    "adam": lambda: optim.adam(0.001),
}
# torch has no row-wise Adagrad: its element-wise sparse Adagrad is the closest peer.
TORCH_OPTIMIZERS = {"sgd": "SGD", "rowwise_adagrad": "Adagrad", "adam": "SparseAdam"}
COPY_BYTES = 1 << 30  # on GPU; 64 MiB elsewhere
CHECK = 1 << 14  # bags and unique rows compared with float64, per workload
# The fused update's schedule keyword, where the kernel has it (the load-balanced one).
PIECE_LEN = inspect.signature(fused_backward_update).parameters.get("piece_len")

_TARGET = LookupSpec(T=8, E=1_000_000, D=128, B=65_536, L=20)  # the target config
# HBM-bound sizes: tables 400-1000x the H200's 50 MB L2, fp32, D=128 (512 B a row).
# hbm: T=4 tables of 10M rows: 4 * 10M * 512 B = 20.5 GB (19.1 GiB); C = B*T*L =
#   5.24M ids, S = T*B = 262,144 bags. Peak with Adam on the XLA path: table, m and v
#   3 * 20.5 = 61.4 GB; its [C, D] float32 temporaries (2.68 GB each: per-id grads,
#   the dedup sum, gathered rows, m and v and their updates) at most 8: 21.5 GB; the
#   bench's copy of the touched rows (restored after each implementation) <= 2.7 GB,
#   output gradient 0.13 GB: ~86 GB = 80 GiB, inside JAX's default pool (75% of the
#   H200's ~139 GiB = 104 GiB). SGD 45 GB; row-wise Adagrad 45 GB + 0.16 GB.
# hbm_large: T=2 tables of 50M rows: 51.2 GB (47.7 GiB), C = 2.62M: SGD and row-wise
#   Adagrad ~64 GB with the same temporaries (1.34 GB each); Adam's 3 * 51.2 = 154 GB
#   cannot fit, and is skipped with a line saying so (``fits``).
_HBM = LookupSpec(T=4, E=10_000_000, D=128, B=65_536, L=20)
_HBM_LARGE = LookupSpec(T=2, E=50_000_000, D=128, B=65_536, L=20)
GPU_PRESETS: dict[str, list[LookupSpec]] = {
    "target": [_TARGET],
    "target_zipf": [dataclasses.replace(_TARGET, alpha=1.15)],
    # FBGEMM-style sweep around the target: dims (incl. a non power of two),
    # pooling factors, skew, weights and table dtypes.
    "gpu_sweep": [
        dataclasses.replace(_TARGET, **kw)
        for kw in (
            {},
            {"alpha": 1.15},
            {"weighted": True},
            {"dtype": "fp16"},
            {"dtype": "bf16"},
            {"D": 64},
            {"D": 96},
            {"D": 256, "B": 16_384},
            {"L": 1},
            {"L": 100, "B": 16_384},
            {"pooling": "MEAN"},
        )
    ],
    # Uniform ids and production skews (Zipf 0.8 / 1.05 / 1.2).
    "hbm": [dataclasses.replace(_HBM, alpha=a) for a in (0.0, 0.8, 1.05, 1.2)],
    # bench/gpu_check.sh's subset: uniform and the two heavier skews.
    "hbm_check": [dataclasses.replace(_HBM, alpha=a) for a in (0.0, 1.05, 1.2)],
    "hbm_large": [dataclasses.replace(_HBM_LARGE, alpha=a) for a in (0.0, 1.05)],
}


def all_presets() -> dict[str, list[LookupSpec]]:
    return {**{k: [v] for k, v in PRESETS.items()}, **GPU_PRESETS}


_OPTIMIZER_OBJECTS: dict[str, optim.SparseOptimizer] = {}


def optimizer(name: str) -> optim.SparseOptimizer:
    """One object per name: kernels take the optimizer as a static argument, hashed by
    identity, so workloads of the same shape reuse each other's compiled programs."""
    if name not in _OPTIMIZER_OBJECTS:
        _OPTIMIZER_OBJECTS[name] = OPTIMIZERS[name]()
    return _OPTIMIZER_OBJECTS[name]


# ----- workload -----
def make_host_batch(spec: LookupSpec, seed: int) -> HostBatch:
    inputs = make_inputs(spec, seed)
    rows = inputs["values"] + np.repeat(np.arange(spec.T), spec.B * spec.L) * spec.E
    lengths = inputs["lengths"]
    seg = np.repeat(np.arange(spec.T * spec.B), lengths)
    w = inputs["weights"]
    scale = np.ones(rows.shape, np.float32) if w is None else w
    return host_batch(rows, seg, lengths, scale, spec.pooling == "MEAN")


@dataclasses.dataclass(frozen=True)
class Batch:
    """The workload on the device."""

    rows: jax.Array  # [C] int32
    starts: jax.Array  # [S] int32
    ends: jax.Array  # [S] int32
    seg: jax.Array  # [C] int32
    scale: jax.Array  # [C] float32
    bwd_scale: jax.Array  # [C] float32
    valid: jax.Array  # [C] bool


def to_device(h: HostBatch) -> Batch:
    return Batch(
        rows=jnp.asarray(h.rows, jnp.int32),
        starts=jnp.asarray(h.starts),
        ends=jnp.asarray(h.ends),
        seg=jnp.asarray(h.seg),
        scale=jnp.asarray(h.scale),
        bwd_scale=jnp.asarray(h.bwd_scale),
        valid=jnp.ones(h.rows.shape, bool),
    )


# ----- tables -----
def make_table(spec: LookupSpec, seed: int) -> tuple[jax.Array, dict]:
    """The stacked ``[T*E, D]`` table, drawn on the device (TorchRec's default range):
    ``jaxrec.ops.init.uniform_rows``, or ``jax.random.uniform`` if that fails."""
    bound = (1.0 / spec.E) ** 0.5
    rows, dtype = spec.T * spec.E, JAX_DTYPES[spec.dtype]
    start = time.perf_counter()
    try:
        piece = TablePiece(0, rows, 0, 0, 0, spec.D, -bound, bound)
        table = uniform_rows(jax.random.key(seed), [piece], rows, spec.D, dtype)
        how = "uniform_rows"
    except Exception as e:  # noqa: BLE001 - a timing run should not die of its initialiser
        print(json.dumps({"bench": BENCH, "note": f"uniform_rows failed: {e!r:.300}"}))
        table = jax.random.uniform(
            jax.random.key(seed), (rows, spec.D), jnp.float32, -bound, bound
        ).astype(dtype)
        how = "jax.random.uniform"
    table.block_until_ready()
    return table, {"table_init": how, "table_init_s": round(time.perf_counter() - start, 3)}


class TableSlot:
    """The table of the last workload, kept for the next one of the same shape: each
    update is undone after it is timed (its touched rows written back), so every
    implementation and workload starts from the same values."""

    def __init__(self):
        self.key, self.table, self.info = None, None, {}

    def take(self, spec: LookupSpec, seed: int) -> tuple[jax.Array, dict]:
        key = (spec.T, spec.E, spec.D, spec.dtype, seed)
        table, self.table = self.table, None
        if key == self.key and table is not None and not table.is_deleted():
            return table, {**self.info, "table_reused": True}
        del table
        gc.collect()
        table, self.info = make_table(spec, seed)
        self.key = key
        return table, {**self.info, "table_reused": False}

    def put(self, table: jax.Array) -> None:
        self.table = table


# ----- bytes -----
def state_bytes_per_row(spec: LookupSpec, opt: optim.SparseOptimizer) -> int:
    state = jax.eval_shape(lambda: opt.init(1, spec.D))
    return int(sum(np.prod(x.shape) * 4 for x in jax.tree.leaves(state)[1:]))


def per_id_bytes(spec: LookupSpec, pass_: str, opt: optim.SparseOptimizer | None = None) -> int:
    """FBGEMM's count, per id (duplicates not discounted), as this bench reported before."""
    if pass_ == "fwd":
        return spec.bytes_read()
    if pass_ == "seq":
        return 2 * spec.bytes_read()
    ids, e = spec.B * spec.T * spec.L, spec.bytes_per_element
    return int(ids * (4 * spec.D + 2 * spec.D * e + 2 * state_bytes_per_row(spec, opt)))


def modelled_bytes(
    spec: LookupSpec, pass_: str, unique_rows: int, opt: optim.SparseOptimizer | None = None
) -> int:
    """The bytes the op must move, each touched row once (module docstring)."""
    c, s, e, d = spec.B * spec.T * spec.L, spec.T * spec.B, spec.bytes_per_element, spec.D
    rows = unique_rows * d * e
    if pass_ == "fwd":
        return 4 * c + 4 * (s + 1) + (4 * c if spec.weighted else 0) + rows + 4 * s * d
    if pass_ == "seq":
        return 4 * c + c + rows + c * d * e
    return 4 * s * d + 13 * c + 2 * (rows + unique_rows * state_bytes_per_row(spec, opt))


def peak_bytes(spec: LookupSpec, opt: optim.SparseOptimizer, unique_rows: int) -> int:
    """The XLA update's peak device bytes, counted as by ``_HBM``: table and state,
    eight ``[C, D]`` float32 temporaries, the saved touched rows, the output gradient."""
    c, d, e = spec.B * spec.T * spec.L, spec.D, spec.bytes_per_element
    need = spec.T * spec.E * (d * e + state_bytes_per_row(spec, opt)) + 8 * c * d * 4
    return need + unique_rows * d * e + spec.T * spec.B * d * 4


def fits(spec: LookupSpec, opt: optim.SparseOptimizer, unique_rows: int) -> tuple[bool, dict]:
    """Whether :func:`peak_bytes` fits 95% of the device's pool (always, where unknown)."""
    need = peak_bytes(spec, opt, unique_rows)
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    return limit is None or need <= 0.95 * limit, {"need_bytes": need, "limit_bytes": limit}


# ----- implementations (jitted once: the batch is an argument, not a constant) -----
def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


@functools.partial(jax.jit, static_argnames=("impl", "mean"))
def pooled(table, rows, starts, ends, seg, scale, *, impl: str, mean: bool):
    if impl == "pallas":
        return pooled_lookup(table, rows, starts, ends, scale, mean=mean, interpret=not on_gpu())
    implementation = "mosaic_gpu" if impl == "mosaic" else "xla"
    out = embedding_bag(table, rows, seg, starts.shape[0], scale, implementation=implementation)
    if mean:
        out = out / jnp.maximum(ends - starts, 1).astype(jnp.float32)[:, None]
    return out


def mosaic_runs(spec: LookupSpec) -> bool:
    """Whether the Mosaic GPU forward can run: sm_90+ and 128-byte rows (no interpreter
    here: its simulation of a GPU is far too slow for a benchmark)."""
    if not on_gpu() or float(getattr(jax.devices()[0], "compute_capability", "0")) < 9.0:
        return False
    return spec.D * {"fp32": 4, "fp16": 2, "bf16": 2}[spec.dtype] % 128 == 0


@functools.partial(jax.jit, static_argnames=("impl",))
def sequence(table, rows, valid, *, impl: str):
    if impl == "pallas":
        return sequence_lookup(table, rows, valid, interpret=not on_gpu())
    return embedding_gather(table, rows, valid, implementation="xla")


@functools.partial(jax.jit, static_argnames=("impl", "opt"), donate_argnums=(0, 1))
def update(table, state, out_grad, seg, scale, rows, valid, *, impl: str, opt):
    """``(table, state)`` after one step; both donated."""
    if impl in ("pallas", "pallas_per_run"):
        kw = {"piece_len": None} if impl == "pallas_per_run" else {}
        return fused_backward_update(
            opt, table, state, out_grad, seg, scale, rows, valid, interpret=not on_gpu(), **kw
        )
    grads = jnp.take(out_grad, seg, axis=0) * scale[:, None]
    unique, summed = dedup_rows(rows, grads, valid, table.shape[0])
    return optim.apply_rows(opt, table, state, unique, summed)


@functools.partial(jax.jit, donate_argnums=(0,))
def _restore(table, rows, values):
    return table.at[rows].set(values, indices_are_sorted=True, unique_indices=True)


def _host(x: jax.Array, idx: np.ndarray) -> np.ndarray:
    """``x[idx]`` gathered on the device, as float32 (exact for every table dtype) on the host."""
    return np.asarray(jnp.take(x, jnp.asarray(idx, jnp.int32), axis=0).astype(jnp.float32))


def copy_bytes() -> int:
    return COPY_BYTES if on_gpu() else COPY_BYTES // 16


def copy_gbps(reps: int) -> float:
    x = jnp.zeros((copy_bytes() // 4,), jnp.float32)
    copy = jax.jit(lambda x: x + 1)
    med = statistics.median(time_ms(lambda: copy(x).block_until_ready(), reps, 2))
    return 2 * x.nbytes / (med * 1e-3) / 1e9


# ----- torch -----
def torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def run_torch(spec, table, h: HostBatch, out_grad, optimizers, reps, warmup) -> dict:
    """``torch.nn.EmbeddingBag`` over the stacked table: forward times and output, and
    the update's times per optimizer (None where torch refuses)."""
    import torch

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    host = np.array(table.astype(jnp.float32))
    dev = torch.device("cuda")
    bag = torch.nn.EmbeddingBag.from_pretrained(
        torch.from_numpy(host).to(dev, dtype), freeze=False, mode=spec.pooling.lower(), sparse=True
    )
    del host
    ids = torch.from_numpy(h.rows).to(dev, torch.int64)
    offsets = torch.from_numpy(h.starts.astype(np.int64)).to(dev)
    psw = torch.from_numpy(h.scale).to(dev, dtype) if spec.weighted else None

    def fwd():
        with torch.no_grad():
            out = bag(ids, offsets, per_sample_weights=psw)
        torch.cuda.synchronize()
        return out

    out = fwd().float().cpu().numpy()
    result = {"out": out, "fwd": time_ms(fwd, reps, warmup), "bwd_update": {}, "names": {}}
    g = torch.from_numpy(np.array(out_grad)).to(dev, dtype)
    for name in optimizers:
        result["names"][name] = TORCH_OPTIMIZERS[name]
        opt = getattr(torch.optim, TORCH_OPTIMIZERS[name])(bag.parameters(), lr=0.01)

        def step(opt=opt):
            opt.zero_grad(set_to_none=True)
            bag(ids, offsets, per_sample_weights=psw).backward(g)
            opt.step()
            torch.cuda.synchronize()

        try:
            result["bwd_update"][name] = time_ms(step, reps, warmup)
        except RuntimeError as e:  # e.g. SparseAdam refuses fp16/bf16 on some versions
            print(json.dumps({"bench": BENCH, "impl": "torch", "skipped": str(e)[:200]}))
        del opt
    result["version"] = torch.__version__
    return result


# ----- running -----
def emit(spec, impl, pass_, times, ceiling, modelled, per_id, **extra) -> dict:
    seconds = statistics.median(times) * 1e-3
    gbps, per_id_gbps = modelled / seconds / 1e9, per_id / seconds / 1e9
    rec = record(
        BENCH,
        spec,
        impl,
        times,
        pass_=pass_,
        modelled_bytes=modelled,
        gbps=round(gbps, 3),
        fraction_of_copy=round(gbps / ceiling, 4),
        per_id_bytes=per_id,
        per_id_gbps=round(per_id_gbps, 3),
        per_id_fraction_of_copy=round(per_id_gbps / ceiling, 4),
        copy_gbps_ceiling=round(ceiling, 3),
        **extra,
    )
    rec["pass"] = rec.pop("pass_")
    print(json.dumps(rec), flush=True)
    return rec


def note(spec: LookupSpec, pass_: str | None, **fields) -> dict:
    """A JSON line that is not a timing (``check``, ``agree``, ``skipped``)."""
    out = {"bench": BENCH, **spec.as_dict(), **({} if pass_ is None else {"pass": pass_})}
    out |= fields
    print(json.dumps(out), flush=True)
    return out


def _piece_len_default():
    """The fused update's default ``piece_len`` as JSON (``"absent"`` without the keyword)."""
    if PIECE_LEN is None:
        return "absent"
    default = PIECE_LEN.default
    return default if default is None or isinstance(default, int | str) else repr(default)


def _impl_extra(impl: str) -> dict:
    if impl == "pallas":
        return {"interpret": not on_gpu(), "schedule": "default", "piece_len": _piece_len_default()}
    if impl == "pallas_per_run":
        return {"interpret": not on_gpu(), "schedule": "per_run", "piece_len": None}
    return {}


@dataclasses.dataclass
class Workload:
    """One workload's inputs, host and device, and what its run has gathered."""

    spec: LookupSpec
    h: HostBatch
    b: Batch
    chk: lookup_checks.Checked
    out_grad: jax.Array
    stats: dict
    ceiling: float
    reps: int
    warmup: int
    records: list = dataclasses.field(default_factory=list)

    def timed(self, impl, pass_, times, opt_name=None, **extra) -> None:
        opt = None if opt_name is None else optimizer(opt_name)
        modelled = modelled_bytes(self.spec, pass_, len(self.h.unique), opt)
        per_id = per_id_bytes(self.spec, pass_, opt)
        if opt_name is not None:
            extra["optimizer"] = opt_name
        line = emit(
            self.spec,
            impl,
            pass_,
            times,
            self.ceiling,
            modelled,
            per_id,
            **self.stats,
            **_impl_extra(impl),
            **extra,
        )
        self.records.append(line)

    def checked(self, pass_: str, checks: dict, **extra) -> None:
        """``check`` lines per (impl, quantity) and the pass's ``agree`` line."""
        if pass_ == "bwd_update":
            count = {"checked_rows": len(self.chk.rows)}
        else:
            count = {"checked_bags": len(self.chk.bags)}
        for (impl, q), c in checks.items():
            self.records.append(
                note(
                    self.spec,
                    pass_,
                    impl=impl,
                    compare=f"{q} vs float64",
                    **extra,
                    **count,
                    **c.record(),
                )
            )
        self.records.append(
            note(self.spec, pass_, **extra, **lookup_checks.summary(checks, JAX_IMPLS))
        )


def run(
    spec: LookupSpec,
    impls: Sequence[str] = IMPLS,
    passes: Sequence[str] = PASSES,
    *,
    optimizers: Sequence[str] = ("rowwise_adagrad",),
    reps: int = 20,
    warmup: int = 3,
    seed: int = 0,
    ceiling: float | None = None,
    check: int = CHECK,
    slot: TableSlot | None = None,
) -> list[dict]:
    """Benchmarks ``spec``; returns the records (timings, ``check`` and ``agree`` lines)."""
    bad = sorted(set(impls) - set(IMPLS)) + sorted(set(passes) - set(PASSES))
    bad += sorted(set(optimizers) - set(OPTIMIZERS))
    if bad:
        raise ValueError(
            f"unknown impls/passes/optimizers {bad}; choose from {IMPLS}, {PASSES} and "
            f"{sorted(OPTIMIZERS)}"
        )
    ceiling = copy_gbps(reps) if ceiling is None else ceiling
    slot = TableSlot() if slot is None else slot
    h = make_host_batch(spec, seed)
    out_grad = jax.random.normal(jax.random.key(seed + 1), (spec.T * spec.B, spec.D))
    w = Workload(
        spec,
        h,
        to_device(h),
        lookup_checks.choose(h, check, seed),
        out_grad,
        h.stats(),
        ceiling,
        reps,
        warmup,
    )
    jax_impls = [i for i in JAX_IMPLS if i in impls]
    if "mosaic" in jax_impls and not mosaic_runs(spec):
        why = "needs a Hopper-or-later GPU and rows of a multiple of 128 bytes"
        note(spec, "fwd", impl="mosaic", skipped=why)
    if "pallas_per_run" in jax_impls and PIECE_LEN is None:
        note(spec, None, impl="pallas_per_run", skipped="fused_backward_update takes no piece_len")
        jax_impls.remove("pallas_per_run")
    table, info = slot.take(spec, seed)
    w.stats |= info
    try:
        values = _host(table, w.chk.fwd_rows)  # the rows the checked bags read
        got = _lookups(w, table, [p for p in ("fwd", "seq") if p in passes], jax_impls)
        if "bwd_update" in passes:
            table = _updates(w, table, optimizers, jax_impls)
        torch_out = None
        if "torch" in impls:  # the table is as drawn again: its forward is checked too
            bwd = optimizers if "bwd_update" in passes else ()
            torch_out = _torch(w, table, "fwd" in passes, bwd)
    finally:
        slot.put(table)
    mean = spec.pooling == "MEAN"
    if "fwd" in got:
        checks = lookup_checks.check_forward(
            h, w.chk, values, mean, spec.dtype, got["fwd"], torch_out
        )
        w.checked("fwd", checks)
    if "seq" in got:
        w.checked("seq", lookup_checks.check_sequence(w.chk, values, got["seq"]))
    return w.records


def _lookups(w: Workload, table, passes, impls) -> dict[str, dict[str, np.ndarray]]:
    """Forward and sequence lookups timed; their outputs at the checked bags, by pass and impl."""
    b, chk, mean = w.b, w.chk, w.spec.pooling == "MEAN"
    got = {}
    for pass_ in passes:
        got[pass_] = {}
        for impl in [i for i in impls if i != "pallas_per_run"]:
            if impl == "mosaic" and (pass_ != "fwd" or not mosaic_runs(w.spec)):
                continue
            if pass_ == "fwd":
                fn = functools.partial(
                    pooled,
                    rows=b.rows,
                    starts=b.starts,
                    ends=b.ends,
                    seg=b.seg,
                    scale=b.scale,
                    impl=impl,
                    mean=mean,
                )
            else:
                fn = functools.partial(sequence, rows=b.rows, valid=b.valid, impl=impl)
            got[pass_][impl] = _host(fn(table), chk.bags if pass_ == "fwd" else chk.positions)
            w.timed(
                impl, pass_, time_ms(lambda f=fn: f(table).block_until_ready(), w.reps, w.warmup)
            )
    return got


def _torch(w: Workload, table, fwd: bool, optimizers) -> np.ndarray | None:
    """``torch.nn.EmbeddingBag``'s forward and updates timed; its output at the checked bags."""
    if not (torch_cuda() and on_gpu()):
        note(w.spec, None, impl="torch", skipped="needs torch with CUDA and a GPU")
        return None
    t = run_torch(w.spec, table, w.h, w.out_grad, optimizers, w.reps, w.warmup)
    if fwd:
        w.timed("torch", "fwd", t["fwd"], torch_version=t["version"])
    for name, times in t["bwd_update"].items():
        w.timed(
            "torch",
            "bwd_update",
            times,
            name,
            torch_optimizer=t["names"][name],
            torch_version=t["version"],
        )
    return t["out"][w.chk.bags] if fwd else None


def _updates(w: Workload, table, optimizers, impls) -> jax.Array:
    """Times each optimizer's update per implementation, each from the same table (its
    touched rows written back after), gathers the checked rows after one step, and
    compares them with float64. Returns the table."""
    spec, b, chk = w.spec, w.b, w.chk
    touched = jnp.asarray(w.h.unique, jnp.int32)
    saved = jnp.take(table, touched, axis=0)
    w0 = _host(table, chk.rows)
    sums = lookup_checks.gradient_sums(w.h, chk, np.asarray(w.out_grad))
    args = (w.out_grad, b.seg, b.bwd_scale, b.rows, b.valid)
    for name in optimizers:
        opt = optimizer(name)
        ok, need = fits(spec, opt, len(w.h.unique))
        if not ok:
            note(spec, "bwd_update", optimizer=name, skipped="does not fit", **need)
            continue
        got = {}
        for impl in impls:
            state = opt.init(table.shape[0], spec.D)
            table, state = update(table, state, *args, impl=impl, opt=opt)
            fields = lookup_checks.state_fields(state)
            got[impl] = (
                _host(table, chk.rows),
                {f: _host(getattr(state, f), chk.rows) for f in fields},
            )
            carry = [table, state]
            del table, state

            def step(carry=carry, impl=impl, opt=opt):
                carry[:] = update(*carry, *args, impl=impl, opt=opt)
                jax.block_until_ready(carry)

            times = time_ms(step, w.reps, w.warmup)
            table = _restore(carry.pop(0), touched, saved)
            carry.clear()  # frees the state before the next one is made
            w.timed(impl, "bwd_update", times, name)
        state0 = opt.init(1, spec.D)
        checks = lookup_checks.check_update(opt, state0, spec.dtype, w0, sums, got)
        w.checked("bwd_update", checks, optimizer=name)
    return table


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spec_args(p)
    add_timing_args(p)
    p.add_argument("--impl", default=",".join(IMPLS), help=f"comma-separated, from {IMPLS}")
    p.add_argument("--pass", dest="passes", default=",".join(PASSES), help=f"from {PASSES}")
    p.add_argument(
        "--optimizer", default="rowwise_adagrad", help=f"comma-separated, from {sorted(OPTIMIZERS)}"
    )
    p.add_argument(
        "--check",
        type=int,
        default=CHECK,
        help="bags and unique rows compared with float64 per workload",
    )
    return p.parse_args(argv)


def specs_from_args(args: argparse.Namespace) -> list[LookupSpec]:
    presets = all_presets()
    names = args.preset.split(",")
    unknown = [n for n in names if n not in presets]
    if unknown:
        raise SystemExit(f"unknown presets {unknown}; choose from {sorted(presets)}")
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(LookupSpec)
        if getattr(args, f.name, None) is not None
    }
    return [dataclasses.replace(s, **overrides) for n in names for s in presets[n]]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ceiling = copy_gbps(args.reps)
    head = {"bench": BENCH, "pass": "copy", "gbps": round(ceiling, 3), "bytes": copy_bytes()}
    head |= {"device_kind": jax.devices()[0].device_kind, "jax_version": jax.__version__}
    head["fused_update_piece_len"] = _piece_len_default()
    print(json.dumps(head), flush=True)
    ok, slot = True, TableSlot()
    for spec in specs_from_args(args):
        records = run(
            spec,
            args.impl.split(","),
            args.passes.split(","),
            optimizers=args.optimizer.split(","),
            reps=args.reps,
            warmup=args.warmup,
            seed=args.seed,
            ceiling=ceiling,
            check=args.check,
            slot=slot,
        )
        ok &= all(r.get("ok", True) for r in records)
        gc.collect()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
