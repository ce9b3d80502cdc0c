"""GPU lookup benchmark: forward and fused backward + update, Pallas vs XLA vs torch.

For each workload (FBGEMM's ``T, E, D, B, L, alpha, weighted, dtype``; the
``T`` tables are stacked in one buffer, one feature each) it times, in the
same process run:

* ``fwd``: the table-batched pooled lookup: jaxrec's Pallas kernel
  (``jaxrec.pallas.pooled_lookup``, one launch), jaxrec's XLA path
  (``jaxrec.ops.embedding_bag``) and ``torch.nn.EmbeddingBag`` over the same
  stacked table (CUDA only);
* ``bwd_update``: from the output gradient to updated rows and optimizer
  state, exact (duplicates summed), tables and state donated: the Pallas
  ``fused_backward_update``, the XLA path (per-id grads, ``dedup_rows``,
  ``apply_rows``), and torch (``EmbeddingBag(sparse=True)`` backward plus
  its closest sparse optimizer, see ``TORCH_OPTIMIZERS``; CUDA only);
* ``seq``: the sequence (unpooled) lookup, ``[B*T*L, D]`` rows out: the Pallas
  ``sequence_lookup`` vs XLA's gather (``jaxrec.ops.embedding_gather``), bytes
  counted read + write (``2*B*T*L*D*bytes``, as the copy ceiling counts them):
  whether the Pallas sequence kernel earns its keep;
* ``copy``: a device-to-device copy (``x + 1`` over 1 GiB, read + write), the
  bandwidth ceiling of this run (64 MiB off GPU).

One JSON line per (workload, pass, implementation) with ``gbps`` and
``fraction_of_copy``; bytes are counted per id as FBGEMM does (duplicates
not discounted): forward ``B*T*L*D*bytes``; backward + update
``B*T*L*(4*D + 2*D*bytes + 2*state_bytes_per_row)`` (the id's float32
gradient row, its table row read and written, its state read and written).
Pallas and XLA outputs and updated tables are compared and the run exits 1
if they disagree.

Off GPU the Pallas kernels run in the Pallas interpreter (``interpret: true``
in the records): only the tiny presets make sense there, as a test. On the
GPU machine::

    python bench/gpu_lookup.py --preset target --reps 20
    python bench/gpu_lookup.py --preset gpu_sweep --reps 10 > bench/results/gpu_lookup_h100.jsonl
    python bench/gpu_lookup.py --preset target --optimizer adam --impl pallas,xla
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from common import EPS, add_spec_args, add_timing_args, record, time_ms  # noqa: E402
from specs import PRESETS, LookupSpec, make_inputs  # noqa: E402

from jaxrec import optim
from jaxrec.ops import embedding_bag, embedding_gather
from jaxrec.pallas import fused_backward_update, pooled_lookup, sequence_lookup
from jaxrec.xla.backward import dedup_rows

BENCH = "gpu_lookup"
IMPLS = ("pallas", "xla", "torch")
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

_TARGET = LookupSpec(T=8, E=1_000_000, D=128, B=65_536, L=20)  # the target config
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
}


def all_presets() -> dict[str, list[LookupSpec]]:
    return {**{k: [v] for k, v in PRESETS.items()}, **GPU_PRESETS}


# ----- workload -----
@dataclasses.dataclass(frozen=True)
class Batch:
    """One workload in the kernels' layout: ids offset into the stacked table, key-major bags."""

    rows: jax.Array  # [C] int32
    starts: jax.Array  # [S] int32, S = T * B
    ends: jax.Array  # [S] int32
    seg: jax.Array  # [C] int32
    scale: jax.Array  # [C] float32 (per-sample weights or ones)
    valid: jax.Array  # [C] bool
    lengths: np.ndarray  # [S] host copy


def make_batch(spec: LookupSpec, seed: int) -> Batch:
    inputs = make_inputs(spec, seed)
    lengths = inputs["lengths"].astype(np.int64)
    ends = np.cumsum(lengths)
    table_of = np.repeat(np.arange(spec.T), spec.B * spec.L)
    rows = inputs["values"] + table_of * spec.E
    seg = np.repeat(np.arange(spec.T * spec.B), lengths)
    w = inputs["weights"]
    scale = np.ones(rows.shape, np.float32) if w is None else w
    return Batch(
        rows=jnp.asarray(rows, jnp.int32),
        starts=jnp.asarray(ends - lengths, jnp.int32),
        ends=jnp.asarray(ends, jnp.int32),
        seg=jnp.asarray(seg, jnp.int32),
        scale=jnp.asarray(scale, jnp.float32),
        valid=jnp.ones(rows.shape, bool),
        lengths=lengths,
    )


def make_table(spec: LookupSpec, seed: int) -> jax.Array:
    bound = (1.0 / spec.E) ** 0.5  # TorchRec's default init range
    shape = (spec.T * spec.E, spec.D)
    table = jax.random.uniform(jax.random.key(seed), shape, jnp.float32, -bound, bound)
    return table.astype(JAX_DTYPES[spec.dtype])


def fwd_bytes(spec: LookupSpec) -> int:
    return spec.bytes_read()


def bwd_bytes(spec: LookupSpec, opt: optim.SparseOptimizer) -> int:
    state = jax.eval_shape(lambda: opt.init(1, spec.D))
    per_row = sum(np.prod(x.shape) * 4 for x in jax.tree.leaves(state)[1:])
    ids = spec.B * spec.T * spec.L
    return int(ids * (4 * spec.D + 2 * spec.D * spec.bytes_per_element + 2 * per_row))


# ----- implementations -----
def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def jax_forward(impl: str, spec: LookupSpec, batch: Batch) -> Callable[[jax.Array], jax.Array]:
    mean, s = spec.pooling == "MEAN", spec.T * spec.B
    if impl == "pallas":
        interpret = not on_gpu()
        return jax.jit(
            lambda t: pooled_lookup(
                t, batch.rows, batch.starts, batch.ends, batch.scale, mean=mean, interpret=interpret
            )
        )

    def xla(t):
        out = embedding_bag(t, batch.rows, batch.seg, s, batch.scale, implementation="xla")
        if mean:
            out = out / jnp.maximum(batch.ends - batch.starts, 1).astype(jnp.float32)[:, None]
        return out

    return jax.jit(xla)


def jax_sequence(impl: str, batch: Batch) -> Callable[[jax.Array], jax.Array]:
    if impl == "pallas":
        interpret = not on_gpu()
        return jax.jit(lambda t: sequence_lookup(t, batch.rows, batch.valid, interpret=interpret))
    return jax.jit(lambda t: embedding_gather(t, batch.rows, batch.valid, implementation="xla"))


def jax_update(impl: str, spec: LookupSpec, batch: Batch, opt) -> Callable:
    """``fn(table, state, out_grad) -> (table, state)``, table and state donated."""
    scale = batch.scale
    if spec.pooling == "MEAN":
        scale = scale / jnp.maximum(jnp.asarray(batch.lengths)[batch.seg], 1).astype(jnp.float32)
    b = dataclasses.replace(batch, scale=scale)
    if impl == "pallas":
        interpret = not on_gpu()

        def fn(table, state, g):
            return fused_backward_update(
                opt, table, state, g, b.seg, b.scale, b.rows, b.valid, interpret=interpret
            )
    else:

        def fn(table, state, g):
            grads = jnp.take(g, b.seg, axis=0) * b.scale[:, None]
            unique, summed = dedup_rows(b.rows, grads, b.valid, table.shape[0])
            return optim.apply_rows(opt, table, state, unique, summed)

    return jax.jit(fn, donate_argnums=(0, 1))


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


def run_torch(spec, table, batch, out_grad, optimizer, reps, warmup) -> dict:
    """``torch.nn.EmbeddingBag`` over the stacked table: forward times/output, update times."""
    import torch

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    host = np.asarray(table.astype(jnp.float32))
    dev = torch.device("cuda")
    bag = torch.nn.EmbeddingBag.from_pretrained(
        torch.from_numpy(host).to(dev, dtype),
        freeze=False,
        mode=spec.pooling.lower(),
        sparse=True,
    )
    ids = torch.from_numpy(np.asarray(batch.rows)).to(dev, torch.int64)
    offsets = torch.from_numpy(np.asarray(batch.starts)).to(dev, torch.int64)
    psw = None
    if spec.weighted:
        psw = torch.from_numpy(np.asarray(batch.scale)).to(dev, dtype)

    def fwd():
        with torch.no_grad():
            out = bag(ids, offsets, per_sample_weights=psw)
        torch.cuda.synchronize()
        return out

    out = fwd().float().cpu().numpy()
    fwd_times = time_ms(fwd, reps, warmup)
    name = TORCH_OPTIMIZERS[optimizer]
    opt = getattr(torch.optim, name)(bag.parameters(), lr=0.01)
    g = torch.from_numpy(np.asarray(out_grad)).to(dev, dtype)

    def step():
        opt.zero_grad(set_to_none=True)
        bag(ids, offsets, per_sample_weights=psw).backward(g)
        opt.step()
        torch.cuda.synchronize()

    try:
        upd_times = time_ms(step, reps, warmup)
    except RuntimeError as e:  # e.g. SparseAdam refuses fp16/bf16 on some versions
        upd_times = None
        print(json.dumps({"bench": BENCH, "impl": "torch", "skipped": str(e)[:200]}), flush=True)
    return {
        "out": out,
        "fwd": fwd_times,
        "bwd_update": upd_times,
        "extra": {"torch_version": torch.__version__, "torch_optimizer": name},
    }


# ----- running -----
def tolerance(spec: LookupSpec) -> float:
    bound = (1.0 / spec.E) ** 0.5
    return 4 * EPS[spec.dtype] * spec.L * bound + 8 * 2.0**-23 * spec.L * bound


def emit(spec, impl, pass_, times, nbytes, ceiling, **extra) -> dict:
    gbps = nbytes / (statistics.median(times) * 1e-3) / 1e9
    rec = record(
        BENCH,
        spec,
        impl,
        times,
        pass_=pass_,
        bytes=nbytes,
        gbps=round(gbps, 3),
        copy_gbps_ceiling=round(ceiling, 3),
        fraction_of_copy=round(gbps / ceiling, 4),
        **extra,
    )
    rec["pass"] = rec.pop("pass_")
    print(json.dumps(rec), flush=True)
    return rec


def run(
    spec: LookupSpec,
    impls: Sequence[str] = IMPLS,
    passes: Sequence[str] = PASSES,
    *,
    optimizer: str = "rowwise_adagrad",
    reps: int = 20,
    warmup: int = 3,
    seed: int = 0,
    ceiling: float | None = None,
) -> list[dict]:
    """Benchmarks ``spec``; returns the records (``agree`` records compare Pallas with XLA)."""
    bad = sorted(set(impls) - set(IMPLS)) + sorted(set(passes) - set(PASSES))
    if bad:
        raise ValueError(f"unknown impls/passes {bad}; choose from {IMPLS} and {PASSES}")
    ceiling = copy_gbps(reps) if ceiling is None else ceiling
    batch = make_batch(spec, seed)
    opt = OPTIMIZERS[optimizer]()
    s = spec.T * spec.B
    out_grad = jax.random.normal(jax.random.key(seed + 1), (s, spec.D), jnp.float32)
    records, outs, tables, seqs = [], {}, {}, {}
    for impl in (i for i in impls if i in ("pallas", "xla")):
        common = {"interpret": not on_gpu()} if impl == "pallas" else {}
        table = make_table(spec, seed)
        if "fwd" in passes:
            fwd = jax_forward(impl, spec, batch)
            outs[impl] = np.asarray(fwd(table))
            times = time_ms(lambda f=fwd, t=table: f(t).block_until_ready(), reps, warmup)
            records.append(emit(spec, impl, "fwd", times, fwd_bytes(spec), ceiling, **common))
        if "seq" in passes:
            seq = jax_sequence(impl, batch)
            seqs[impl] = np.asarray(seq(table).astype(jnp.float32))
            times = time_ms(lambda f=seq, t=table: f(t).block_until_ready(), reps, warmup)
            records.append(emit(spec, impl, "seq", times, 2 * fwd_bytes(spec), ceiling, **common))
        if "bwd_update" in passes:
            upd = jax_update(impl, spec, batch, opt)
            carry = list(upd(table, opt.init(table.shape[0], spec.D), out_grad))  # one step
            tables[impl] = np.asarray(carry[0].astype(jnp.float32))

            def step(upd=upd, carry=carry):
                carry[:] = upd(*carry, out_grad)
                jax.block_until_ready(carry)

            times = time_ms(step, reps, warmup)
            nbytes = bwd_bytes(spec, opt)
            extra = {**common, "optimizer": optimizer}
            records.append(emit(spec, impl, "bwd_update", times, nbytes, ceiling, **extra))
            del carry
        del table
        gc.collect()
    if "torch" in impls:
        if torch_cuda() and on_gpu():
            t = run_torch(spec, make_table(spec, seed), batch, out_grad, optimizer, reps, warmup)
            outs["torch"] = t["out"]
            for p in passes:
                if t.get(p) is not None:
                    nbytes = fwd_bytes(spec) if p == "fwd" else bwd_bytes(spec, opt)
                    records.append(emit(spec, "torch", p, t[p], nbytes, ceiling, **t["extra"]))
        else:
            line = {"bench": BENCH, "impl": "torch", "skipped": "needs torch with CUDA and a GPU"}
            print(json.dumps(line), flush=True)
    records += _agreement(spec, outs, tables, seqs)
    return records


def _agreement(spec, outs, tables, seqs) -> list[dict]:
    tol, lines = tolerance(spec), []
    pairs = [("fwd", outs, other) for other in ("pallas", "torch") if other in outs]
    pairs += [("bwd_update", tables, "pallas")] if "pallas" in tables else []
    pairs += [("seq", seqs, "pallas")] if "pallas" in seqs else []
    for pass_, got, other in pairs:
        if "xla" not in got:
            continue
        diff = float(np.max(np.abs(got[other] - got["xla"]))) if got["xla"].size else 0.0
        line = {
            "bench": BENCH,
            **spec.as_dict(),
            "pass": pass_,
            "compare": f"{other} vs xla",
            "max_abs_diff": diff,
            "tolerance": tol,
            "agree": diff <= tol,
        }
        print(json.dumps(line), flush=True)
        lines.append(line)
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spec_args(p)
    add_timing_args(p)
    p.add_argument("--impl", default=",".join(IMPLS), help=f"comma-separated, from {IMPLS}")
    p.add_argument("--pass", dest="passes", default=",".join(PASSES), help=f"from {PASSES}")
    p.add_argument("--optimizer", default="rowwise_adagrad", choices=sorted(OPTIMIZERS))
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
    line = {"bench": BENCH, "pass": "copy", "gbps": round(ceiling, 3), "bytes": copy_bytes()}
    line |= {"device_kind": jax.devices()[0].device_kind, "jax_version": jax.__version__}
    print(json.dumps(line), flush=True)
    agree = True
    for spec in specs_from_args(args):
        records = run(
            spec,
            args.impl.split(","),
            args.passes.split(","),
            optimizer=args.optimizer,
            reps=args.reps,
            warmup=args.warmup,
            seed=args.seed,
            ceiling=ceiling,
        )
        agree &= all(r.get("agree", True) for r in records)
        gc.collect()
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
