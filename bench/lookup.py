"""Pooled-lookup benchmark: jaxrec's EmbeddingBagCollection forward vs TorchRec's.

Prints one JSON line per (configuration, implementation), then one line per
jaxrec implementation with its speed-up over TorchRec and the largest output
difference (the run exits 1 if outputs disagree, so small presets are tests).

Run from the repository root with jaxrec installed (``pip install -e .``) or
on the path (``PYTHONPATH=.``)::

    python bench/lookup.py --preset tiny
    python bench/lookup.py --preset default --reps 10
    python bench/lookup.py --T 4 --E 100000 --D 64 --B 1024 --L 20 --alpha 1.1 --weighted
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from common import (  # noqa: E402
    EPS,
    add_spec_args,
    add_timing_args,
    build_jaxrec,
    build_torchrec,
    jaxrec_kjt,
    record,
    specs_from_args,
    time_ms,
    torchrec_available,
    torchrec_kjt,
)
from flax import nnx
from specs import LookupSpec, make_inputs  # noqa: E402

from jaxrec import BoundsCheckMode, EmbeddingBagCollection

BENCH = "lookup"
JAXREC_IMPLS = {"xla": "xla", "pallas": "pallas", "auto": None}
IMPLS = (*JAXREC_IMPLS, "torchrec")


# ----- jaxrec -----
def jaxrec_forward(ebc: EmbeddingBagCollection, implementation: str | None) -> Callable:
    """``fn(kjt) -> [B, T * D]``: a ``jax.jit`` over the split state (merge only at trace)."""
    ebc.implementation = implementation  # a static attribute: part of the graphdef
    graphdef, state = nnx.split(ebc)

    @jax.jit
    def forward(state, kjt):
        return nnx.merge(graphdef, state)(kjt).values()

    return lambda kjt: forward(state, kjt)


# ----- timing and reporting -----
def copy_gbps(nbytes: int, reps: int = 10) -> float:
    """Device-to-device copy bandwidth (read + write) of an ``nbytes`` buffer: the ceiling."""
    x = jnp.zeros((max(nbytes // 4, 1),), jnp.float32)
    copy = jax.jit(lambda x: x + 1)
    med = statistics.median(time_ms(lambda: copy(x).block_until_ready(), reps, 2))
    return 2 * x.nbytes / (med * 1e-3) / 1e9


def lookup_record(spec: LookupSpec, impl: str, times: Sequence[float], **extra) -> dict:
    """A ``record`` plus FBGEMM-counted forward bytes and GB/s."""
    gbps = spec.bytes_read() / (statistics.median(times) * 1e-3) / 1e9
    return record(
        BENCH, spec, impl, times, bytes_read=spec.bytes_read(), gbps=round(gbps, 3), **extra
    )


def tolerance(spec: LookupSpec) -> float:
    """Max abs difference allowed: a few ulps of each table's init bound, times ``L``."""
    bound = (1.0 / spec.E) ** 0.5  # TorchRec's (and jaxrec's) default init range
    return 4 * EPS[spec.dtype] * spec.L * bound


def run(
    spec: LookupSpec,
    impls: Sequence[str] = ("xla", "torchrec"),
    *,
    reps: int = 20,
    warmup: int = 3,
    seed: int = 0,
    bounds_check: str = "WARNING",
) -> list[dict]:
    """Benchmarks ``spec`` with each implementation; returns the JSON records.

    Args:
        spec: the workload.
        impls: jaxrec implementations (``"xla"``, ``"pallas"``, ``"auto"``) and/or
            ``"torchrec"`` (left out when TorchRec is not importable).
        reps: timed repetitions.
        warmup: untimed calls first (the first one compiles).
        seed: seeds the inputs and the weights.
        bounds_check: jaxrec's ``BoundsCheckMode`` name.

    Returns:
        One record per implementation, then per jaxrec implementation a
        ``ratio_jaxrec_over_torchrec`` record when TorchRec ran.
    """
    bad = sorted(set(impls) - set(IMPLS))
    if bad:
        raise ValueError(f"unknown impls {bad}; choose from {IMPLS}")
    inputs = make_inputs(spec, seed)
    ebc = build_jaxrec(spec, seed=seed, bounds_check=bounds_check)
    jax.block_until_ready(nnx.state(ebc))  # init transients freed before anything else
    kjt = jaxrec_kjt(spec, inputs)
    on_gpu = jax.devices()[0].platform != "cpu"
    records, outputs = [], {}
    for impl in (i for i in impls if i in JAXREC_IMPLS):
        fwd = jaxrec_forward(ebc, JAXREC_IMPLS[impl])
        try:
            outputs[impl] = np.asarray(fwd(kjt), np.float32)
        except NotImplementedError as e:  # e.g. no Pallas kernel on this backend
            print(json.dumps({"bench": BENCH, "impl": impl, "skipped": str(e)}), flush=True)
            continue
        times = time_ms(lambda f=fwd: f(kjt).block_until_ready(), reps, warmup)
        extra = {"bounds_check_mode": bounds_check}
        if on_gpu:
            extra["copy_gbps_ceiling"] = round(copy_gbps(spec.bytes_read()), 3)
        records.append(lookup_record(spec, impl, times, **extra))
        print(json.dumps(records[-1]), flush=True)
    if "torchrec" in impls and torchrec_available():
        records += _run_torchrec(spec, ebc, inputs, outputs, records, reps, warmup)
    return records


def _run_torchrec(spec, ebc, inputs, outputs, jax_records, reps, warmup) -> list[dict]:
    import torch
    import torchrec

    if spec.weighted and spec.pooling == "MEAN":  # torch.nn.EmbeddingBag refuses it
        line = {"bench": BENCH, "impl": "torchrec", "skipped": "weighted MEAN is unsupported"}
        print(json.dumps(line), flush=True)
        return []
    torch.set_num_threads(os.cpu_count() or 1)
    tebc = build_torchrec(spec, ebc)
    gc.collect()
    weight_dtype = next(iter(tebc.parameters())).dtype
    tkjt = torchrec_kjt(inputs, weight_dtype)
    with torch.no_grad():
        ref = tebc(tkjt).values().float().numpy()
        times = time_ms(lambda: tebc(tkjt), reps, warmup)
    rec = lookup_record(
        spec,
        "torchrec",
        times,
        torch_version=torch.__version__,
        torchrec_version=getattr(torchrec, "__version__", "unknown"),
        torch_threads=torch.get_num_threads(),
        torch_weight_dtype=str(weight_dtype).removeprefix("torch."),
        device_kind="cpu",
        platform="cpu",
    )
    print(json.dumps(rec), flush=True)
    out = [rec]
    tol = tolerance(spec)
    for jrec in jax_records:
        diff = float(np.max(np.abs(outputs[jrec["impl"]] - ref))) if ref.size else 0.0
        line = {
            "bench": BENCH,
            "impl": jrec["impl"],
            **spec.as_dict(),
            "platform": jrec["platform"],
            "ratio_jaxrec_over_torchrec": round(rec["median_ms"] / jrec["median_ms"], 3),
            "ratio_meaning": "torchrec median_ms / jaxrec median_ms; > 1 means jaxrec is faster",
            "max_abs_diff": diff,
            "tolerance": tol,
            "outputs_agree": diff <= tol,
        }
        print(json.dumps(line), flush=True)
        out.append(line)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spec_args(p)
    add_timing_args(p)
    p.add_argument("--bounds-check", default="WARNING", choices=[m.name for m in BoundsCheckMode])
    p.add_argument("--impl", default="xla,torchrec", help=f"comma-separated, from {IMPLS}")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    agree = True
    for spec in specs_from_args(args):
        records = run(
            spec,
            args.impl.split(","),
            reps=args.reps,
            warmup=args.warmup,
            seed=args.seed,
            bounds_check=args.bounds_check,
        )
        agree &= all(r.get("outputs_agree", True) for r in records)
        gc.collect()
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
