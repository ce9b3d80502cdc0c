"""Throughput of the C++ table initialiser (``jaxrec_uniform_rows``) on a large buffer.

One float32 table of ``--mb`` MiB per dim, drawn whole (one piece), beside numpy's
``default_rng().random(n, dtype=float32, out=buf)`` filling the same bytes in the
same run (a preallocated buffer, so numpy pays no page faults; the kernel's
output is a fresh XLA buffer each call, whose first touch faults its pages in).
``--xla`` adds the XLA reference (``uniform_rows_xla``, jitted). Threads:
``JAXREC_CPU_THREADS``. Prints one JSON record per dim: GB/s, medians of
``--reps`` runs.

    JAX_PLATFORMS=cpu JAXREC_CPU_THREADS=1 python bench/init_cpu.py --dims 16 64 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import machine

from jaxrec.cpu import build_info
from jaxrec.ops.init import draw_rows


def _seconds(fn, *args, **kwargs) -> float:
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    if isinstance(out, jax.Array):
        out.block_until_ready()
    return time.perf_counter() - t


def bench_dim(d: int, mb: int, reps: int, xla: bool) -> dict:
    """GB/s of the kernel, numpy (and XLA) drawing a ``[rows, d]`` float32 table of ``mb`` MiB."""
    key = jnp.array([1, 2], jnp.uint32)
    rng = np.random.default_rng(0)
    rows = (mb << 20) // (4 * d)
    nbytes = rows * d * 4
    ints = jnp.array([[0, rows, 0, 0, 0, d]], jnp.int32)
    floats = jnp.array([[0.0, 0.01]], jnp.float32)
    kw = dict(rows=rows, cols=d, dtype=jnp.float32)
    kernel = jax.jit(lambda k, i, f: draw_rows(k, i, f, implementation="cpu", **kw))
    kernel(key, ints, floats).block_until_ready()
    buf = np.empty(rows * d, np.float32)
    rng.random(buf.size, dtype=np.float32, out=buf)  # faults its pages in once
    times = {"kernel": [], "numpy": []}
    for _ in range(reps):  # interleaved: both see the same load
        times["kernel"].append(_seconds(kernel, key, ints, floats))
        times["numpy"].append(_seconds(rng.random, buf.size, dtype=np.float32, out=buf))
    del buf
    if xla:
        ref = jax.jit(lambda k, i, f: draw_rows(k, i, f, implementation="xla", aligned=True, **kw))
        ref(key, ints, floats).block_until_ready()
        times["xla"] = [_seconds(ref, key, ints, floats) for _ in range(3)]
    return {
        "bench": "init_cpu",
        **machine(),
        "jax_version": jax.__version__,
        "dim": d,
        "rows": rows,
        "mb": nbytes / 2**20,
        "threads": os.environ.get("JAXREC_CPU_THREADS", str(build_info()["max_threads"])),
        "reps": reps,
        **{f"{k}_gbs": nbytes / statistics.median(v) / 1e9 for k, v in times.items()},
        **{f"{k}_gbs_best": nbytes / min(v) / 1e9 for k, v in times.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--xla", action="store_true", help="also time the XLA reference (3 runs)")
    args = ap.parse_args()
    for d in args.dims:
        print(json.dumps(bench_dim(d, args.mb, args.reps, args.xla)), flush=True)


if __name__ == "__main__":
    main()
