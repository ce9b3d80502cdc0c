"""Quantized pooled-lookup benchmark: INT8 / INT4 / FP16 / BF16 rows vs the float32 table.

Builds one float32 ``EmbeddingBagCollection`` per spec, quantizes it with
``QuantEmbeddingBagCollection.from_float`` per dtype, and times the jitted
forward of each in the same process. Prints one JSON line per dtype: timings,
table bytes, FBGEMM-counted bytes read (``B * T * L * row_bytes``), GB/s,
``speedup_vs_fp32`` (fp32 median / this median), ``table_bytes_ratio_vs_fp32``
and the largest output difference from the float32 module. The run exits 1
if a quantized output strays beyond its error bound, so small presets are tests.

Run from the repository root (``PYTHONPATH=.`` or jaxrec installed)::

    python bench/quant_lookup.py --preset tiny
    python bench/quant_lookup.py --preset small --impl xla --reps 10
    python bench/quant_lookup.py --T 4 --E 100000 --D 64 --B 1024 --L 20 --qdtypes int8,int4
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from collections.abc import Sequence

import jax
import numpy as np
from common import (  # noqa: E402
    add_spec_args,
    add_timing_args,
    build_jaxrec,
    jaxrec_kjt,
    record,
    specs_from_args,
    time_ms,
)
from flax import nnx
from specs import LookupSpec, make_inputs  # noqa: E402

from jaxrec.inference import QuantEmbeddingBagCollection, quantize_rows, row_bytes
from jaxrec.xla.quantize import row_error_bound

BENCH = "quant_lookup"
QDTYPES = ("int8", "int4", "fp16", "bf16")
IMPLS = {"xla": "xla", "pallas": "pallas", "auto": None}


def forward(module):
    """``fn(kjt) -> [B, T * D]``: a ``jax.jit`` over the split state."""
    graphdef, state = nnx.split(module)
    fn = jax.jit(lambda s, k: nnx.merge(graphdef, s)(k).values())
    return lambda kjt: fn(state, kjt)


def error_bound(spec: LookupSpec, ebc, dtype: str) -> float:
    """Largest pooled error allowed: ``L`` x the largest row bound (x max weight 1)."""
    worst = 0.0
    for w in ebc.state_dict().values():
        bound = row_error_bound(w, quantize_rows(w, dtype), dtype)
        worst = max(worst, float(np.max(np.asarray(bound))))
    return spec.L * worst * (1 + 1e-3) + 1e-6 * spec.L


def run(
    spec: LookupSpec,
    qdtypes: Sequence[str] = QDTYPES,
    *,
    impl: str = "xla",
    reps: int = 20,
    warmup: int = 3,
    seed: int = 0,
) -> list[dict]:
    """Benchmarks the float32 module then each quantized dtype; returns the JSON records."""
    bad = sorted(set(qdtypes) - set(QDTYPES))
    if bad:
        raise ValueError(f"unknown qdtypes {bad}; choose from {QDTYPES}")
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose from {sorted(IMPLS)}")
    if spec.dtype != "fp32":
        raise ValueError("the baseline table is float32: leave --dtype at fp32")
    inputs = make_inputs(spec, seed)
    ebc = build_jaxrec(spec, seed=seed)
    kjt = jaxrec_kjt(spec, inputs)
    fp32_fwd = forward(ebc)
    ref = np.asarray(fp32_fwd(kjt))
    times = time_ms(lambda: fp32_fwd(kjt).block_until_ready(), reps, warmup)
    fp32_bytes = spec.T * spec.E * spec.D * 4
    base = _record(spec, "fp32", "xla", times, fp32_bytes, spec.D * 4, None)
    print(json.dumps(base), flush=True)
    records = [base]
    for dtype in qdtypes:
        q = QuantEmbeddingBagCollection.from_float(ebc, dtype, implementation=IMPLS[impl])
        fwd = forward(q)
        try:
            out = np.asarray(fwd(kjt))
        except NotImplementedError as e:
            print(json.dumps({"bench": BENCH, "qdtype": dtype, "skipped": str(e)}), flush=True)
            continue
        times = time_ms(lambda f=fwd: f(kjt).block_until_ready(), reps, warmup)
        diff = float(np.max(np.abs(out - ref))) if ref.size else 0.0
        bound = error_bound(spec, ebc, dtype)
        rec = _record(spec, dtype, impl, times, q.table_bytes(), row_bytes(spec.D, dtype), base)
        rec.update(max_abs_diff_vs_fp32=diff, error_bound=bound, within_bound=diff <= bound)
        print(json.dumps(rec), flush=True)
        records.append(rec)
        del q, fwd
        gc.collect()
    return records


def _record(spec, dtype, impl, times, table_bytes, bytes_per_row, base) -> dict:
    read = spec.B * spec.T * spec.L * bytes_per_row
    med = statistics.median(times)
    rec = record(
        BENCH,
        spec,
        impl,
        times,
        qdtype=dtype,
        table_bytes=table_bytes,
        bytes_read=read,
        gbps=round(read / (med * 1e-3) / 1e9, 3),
    )
    if base is not None:
        rec["speedup_vs_fp32"] = round(base["median_ms"] / med, 3)
        rec["table_bytes_ratio_vs_fp32"] = round(table_bytes / base["table_bytes"], 4)
        rec["ratio_meaning"] = "speedup > 1: faster than fp32; bytes ratio < 1: smaller"
    return rec


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spec_args(p)
    add_timing_args(p)
    p.add_argument("--qdtypes", default=",".join(QDTYPES), help=f"comma-separated, {QDTYPES}")
    p.add_argument("--impl", default="xla", choices=sorted(IMPLS))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ok = True
    for spec in specs_from_args(args):
        records = run(
            spec,
            args.qdtypes.split(","),
            impl=args.impl,
            reps=args.reps,
            warmup=args.warmup,
            seed=args.seed,
        )
        ok &= all(r.get("within_bound", True) for r in records)
        gc.collect()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
