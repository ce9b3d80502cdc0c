"""Helpers shared by the benchmark scripts.

Builds jaxrec's and TorchRec's ``EmbeddingBagCollection`` for a ``LookupSpec``
(tables ``"t<i>"`` reading features ``"f<i>"``) and their KJT inputs, times
calls, and formats the JSON records every benchmark prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from specs import PRESETS, LookupSpec

import jaxrec
from jaxrec import (
    BoundsCheckMode,
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    PoolingType,
)

# Machine epsilon per table dtype, for parity tolerances.
EPS = {"fp32": 2.0**-23, "fp16": 2.0**-10, "bf16": 2.0**-7}


# ----- jaxrec -----
def build_jaxrec(spec: LookupSpec, *, seed: int = 0, bounds_check: str = "WARNING"):
    """An ``EmbeddingBagCollection`` of ``T`` tables ``"t<i>"`` reading features ``"f<i>"``."""
    tables = [
        EmbeddingBagConfig(
            name=f"t{t}",
            num_embeddings=spec.E,
            embedding_dim=spec.D,
            feature_names=[f"f{t}"],
            data_type=DataType[spec.dtype.upper()],
            pooling=PoolingType[spec.pooling],
        )
        for t in range(spec.T)
    ]
    return EmbeddingBagCollection(
        tables,
        is_weighted=spec.weighted,
        rngs=nnx.Rngs(seed),
        bounds_check_mode=BoundsCheckMode[bounds_check],
    )


def jaxrec_kjt(spec: LookupSpec, inputs: dict) -> KeyedJaggedTensor:
    """The inputs as a jaxrec KJT, each key's capacity exactly ``B * L`` (no padding)."""
    return KeyedJaggedTensor(
        inputs["keys"],
        inputs["values"],
        inputs["weights"],
        lengths=inputs["lengths"],
        capacities=[spec.B * spec.L] * spec.T,
    )


# ----- torchrec -----
def torchrec_available() -> bool:
    try:
        import torchrec  # noqa: F401
    except ImportError:
        return False
    return True


def torchrec_tables(spec: LookupSpec) -> list:
    """TorchRec ``EmbeddingBagConfig`` s matching :func:`build_jaxrec`'s tables."""
    import torchrec

    return [
        torchrec.EmbeddingBagConfig(
            name=f"t{t}",
            num_embeddings=spec.E,
            embedding_dim=spec.D,
            feature_names=[f"f{t}"],
            data_type=torchrec.DataType[spec.dtype.upper()],
            pooling=torchrec.PoolingType[spec.pooling],
        )
        for t in range(spec.T)
    ]


def build_torchrec(spec: LookupSpec, ebc: EmbeddingBagCollection):
    """TorchRec's ``EmbeddingBagCollection`` holding ``ebc``'s weights.

    Built on the meta device and filled with ``assign=True``, one table at a
    time: each ``state_dict`` slice is copied to the host and dropped in turn,
    so memory peaks near two copies of the weights plus one table.
    TorchRec stores every non-FP32 table as fp16 (bf16 included); the weights
    are cast to whatever dtype it chose.
    """
    import torch
    import torchrec

    tebc = torchrec.EmbeddingBagCollection(
        torchrec_tables(spec), is_weighted=spec.weighted, device=torch.device("meta")
    )
    state = ebc.state_dict()
    for key in list(state):
        param = tebc.state_dict()[key]
        host = np.array(state.pop(key))  # copy; frees the JAX slice below
        if spec.dtype == "bf16":  # torch.from_numpy has no bfloat16
            w = torch.from_numpy(host.view(np.uint16)).view(torch.bfloat16)
        else:
            w = torch.from_numpy(host)
        tebc.load_state_dict({key: w.to(param.dtype)}, strict=False, assign=True)
        del host, w
    return tebc


def torchrec_kjt(inputs: dict, weight_dtype=None):
    """The inputs as a TorchRec KJT; per-sample weights cast to ``weight_dtype``.

    ``torch.nn.EmbeddingBag`` needs per-sample weights in the table's dtype.
    """
    import torch
    import torchrec

    weights = inputs["weights"]
    if weights is not None:
        weights = torch.from_numpy(weights).to(weight_dtype or torch.float32)
    return torchrec.KeyedJaggedTensor(
        keys=inputs["keys"],
        values=torch.from_numpy(inputs["values"]),
        lengths=torch.from_numpy(inputs["lengths"]),
        weights=weights,
    )


# ----- timing and reporting -----
def time_ms(fn: Callable[[], object], reps: int, warmup: int) -> list[float]:
    """Wall times in ms of ``fn()`` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The CPU this runs on: model, cores it may use, each cache level's size per
    instance, and glibc's tunables (``jaxrec.cpu.hugepages``)."""
    caches = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(base)):
            if not index.startswith("index"):
                continue
            path = os.path.join(base, index)
            with open(os.path.join(path, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(path, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(path, "size")) as f:
                size = f.read().strip()
            if kind != "Instruction":
                caches["L" + level + ("d" if kind == "Data" else "")] = size
    except OSError:
        pass
    return {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "cpus_online": os.cpu_count(),
        "caches": caches,
        # glibc.malloc.hugetlb=1 here: large buffers on huge pages from their first touch
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }


def record(bench: str, spec: LookupSpec, impl: str, times: Sequence[float], **extra) -> dict:
    """One JSON-able result: spec fields, environment, timings, then ``extra``."""
    dev = jax.devices()[0]
    return {
        "bench": bench,
        "impl": impl,
        **spec.as_dict(),
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "cpu": cpu_model(),
        "jax_version": jax.__version__,
        "jaxrec_version": jaxrec.__version__,
        "reps": len(times),
        "median_ms": round(statistics.median(times), 4),
        "min_ms": round(min(times), 4),
        "max_ms": round(max(times), 4),
        **extra,
    }


# ----- arguments -----
def emit(rec: dict, out: str | None = None) -> None:
    """Prints one JSON line, and appends it to ``out`` if given (as it is measured)."""
    line = json.dumps(rec)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """``--preset`` and per-field overrides of ``LookupSpec``, in FBGEMM's names."""
    p.add_argument("--preset", default="tiny", help=f"comma-separated, from {sorted(PRESETS)}")
    for name in ("T", "E", "D", "B", "L"):
        p.add_argument(f"--{name}", type=int, help="overrides the preset")
    p.add_argument("--alpha", type=float, help="Zipf exponent; 0 is uniform")
    p.add_argument("--weighted", action="store_true", default=None)
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"))
    p.add_argument("--pooling", choices=("SUM", "MEAN"))


def add_timing_args(p: argparse.ArgumentParser, reps: int = 20, warmup: int = 3) -> None:
    """``--reps``, ``--warmup`` and ``--seed``, as every lookup benchmark takes them."""
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--seed", type=int, default=0)


def specs_from_args(args: argparse.Namespace) -> list[LookupSpec]:
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(LookupSpec)
        if getattr(args, f.name, None) is not None
    }
    names = args.preset.split(",")
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        raise SystemExit(f"unknown presets {unknown}; choose from {sorted(PRESETS)}")
    return [dataclasses.replace(PRESETS[n], **overrides) for n in names]
