"""Throughput of the table initialiser (``jaxrec.ops.init``) on a large buffer, any backend.

One float32 table of ``--mb`` MiB per dim, drawn whole (one piece) by the default
implementation (the C++ kernel on CPUs, the XLA program on GPUs), beside, in the
same run: the device's copy of the same bytes (a reversed copy: it reads and writes
them), and on CPUs numpy's ``default_rng().random(n, dtype=float32, out=buf)``
filling a preallocated buffer (so numpy pays no page faults; the draw's output is a
fresh buffer each call, whose first touch faults its pages in). ``--xla`` adds the
XLA path on CPUs. Threads on CPU: ``JAXREC_CPU_THREADS``. One JSON record per dim:
GB/s written (medians and bests of ``--reps``); ``copy_gbs`` counts the bytes the
copy writes, ``copy_moved_gbs`` those it reads and writes.

    JAX_PLATFORMS=cpu JAXREC_CPU_THREADS=1 python bench/init_rows.py --dims 16 64 128
    python bench/init_rows.py --dims 16 128 --mb 2048     # on a GPU (bench/gpu_check.sh)
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

from jaxrec.ops.init import draw_rows


def _seconds(fn, *args, **kwargs) -> float:
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    if isinstance(out, jax.Array):
        out.block_until_ready()
    return time.perf_counter() - t


def bench_dim(d: int, mb: int, reps: int, xla: bool) -> dict:
    """GB/s of the draw, the device copy (and numpy, XLA on CPU) for a ``[rows, d]`` table."""
    cpu = jax.default_backend() == "cpu"
    key = jnp.array([1, 2], jnp.uint32)
    rows = (mb << 20) // (4 * d)
    nbytes = rows * d * 4
    ints = jnp.array([[0, rows, 0, 0, 0, d]], jnp.int32)
    floats = jnp.array([[0.0, 0.01]], jnp.float32)
    kw = dict(rows=rows, cols=d, dtype=jnp.float32, aligned=True)
    draw = jax.jit(lambda k, i, f: draw_rows(k, i, f, **kw))
    table = draw(key, ints, floats).block_until_ready()
    copy = jax.jit(lambda x: x[::-1])
    copy(table).block_until_ready()
    times: dict[str, list[float]] = {"draw": [], "copy": []}
    if cpu:
        rng = np.random.default_rng(0)
        buf = np.empty(rows * d, np.float32)
        rng.random(buf.size, dtype=np.float32, out=buf)  # faults its pages in once
        times["numpy"] = []
    for _ in range(reps):  # interleaved: all see the same load
        times["draw"].append(_seconds(draw, key, ints, floats))
        times["copy"].append(_seconds(copy, table))
        if cpu:
            times["numpy"].append(_seconds(rng.random, buf.size, dtype=np.float32, out=buf))
    if xla and cpu:
        ref = jax.jit(lambda k, i, f: draw_rows(k, i, f, implementation="xla", **kw))
        ref(key, ints, floats).block_until_ready()
        times["xla"] = [_seconds(ref, key, ints, floats) for _ in range(3)]
    out = {
        "bench": "init_rows",
        **machine(),
        "device_kind": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
        "jax_version": jax.__version__,
        "dim": d,
        "rows": rows,
        "mb": nbytes / 2**20,
        "reps": reps,
        **{f"{k}_gbs": nbytes / statistics.median(v) / 1e9 for k, v in times.items()},
        **{f"{k}_gbs_best": nbytes / min(v) / 1e9 for k, v in times.items()},
    }
    out["copy_moved_gbs"] = 2 * out["copy_gbs"]
    out["draw_over_copy"] = out["draw_gbs"] / out["copy_gbs"]
    if cpu:
        out["threads"] = os.environ.get("JAXREC_CPU_THREADS", str(os.cpu_count()))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--xla", action="store_true", help="on CPUs, also time the XLA path")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    for d in args.dims:
        print(json.dumps(bench_dim(d, args.mb, args.reps, args.xla)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
