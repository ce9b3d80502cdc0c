"""Host-memory tables with a device row cache: hit rate and step time against cache size.

For each id distribution (uniform, Zipf ``alpha``) and cache load factor, trains
``T`` cached tables (``jaxrec.cache``, row-wise Adagrad) and, in the same run, the
same model with every table in device memory; prints one JSON line per case:
the hit rate over the timed steps (ids served from the cache), rows moved per step,
the median step time of the cached step (prepare + load + train step, waited for),
of the pipelined one (``TrainPipeline`` with ``prefetching``: the next batch is
planned while a step runs) and of the all-device step (waited for, and in a
``TrainPipeline``), and their ratios (pipelined over pipelined), and the raw
copies of the step's moved rows (``move_floor_ms``: no cached step beats the
all-device step plus that), and the bytes the moves copy per step (rows in + out
times the weight row and its optimizer rows) with the rate that implies at the
step times. A first line gives the machine and the copy rates that bound a miss:
host gather (numpy), host -> device and device -> host from pageable numpy
memory, and the same copies between a ``pinned_host`` array and device memory
(the cache's staging off the CPU; null with a reason where a memory kind is
missing). ``--slot-maps device|host`` picks ``RowCache``'s planner (a comma list
runs both on each case); each line records it.

``--host-scaling`` (only that, after the copy rates): does the host's work per
step grow with the missed rows or with the ids? With ``slot_maps="device"`` the
ids are planned on the device and the host handles only the moves (a few numbers
and a row copy per miss); with ``"host"`` it runs C++ passes over every id. The
cache (``--hs-load-factor`` of ``--rows`` rows per table) is first filled with
rows never used again, so every later miss evicts a row. Then, at each scale
``s`` (``--hs-scales``, default 1, 2, 4), each table's batch has ``s * --hs-ids``
ids: ``--hs-misses`` rows never looked up before (each one miss) and a pool of
``(s * ids - misses) / --hs-repeats`` rows repeated ``--hs-repeats`` times. The
pool is loaded by untimed warm-up steps and every step looks up all of it, so
LRU never evicts it: the timed steps miss exactly the fresh rows (each line
checks ``CacheStats``: ``misses_as_built``) while ids and distinct rows grow
with ``s``. Per step it times ``prepare`` and ``load`` by ``time.thread_time()``
of the calling thread (``host_cpu_ms``; ``host_cpu_prepare_ms`` /
``host_cpu_load_ms``): the host's own work, which a wait for the device does
not count (a blocked thread uses no CPU; JAX runs programs on its own threads).
Planning runs on the calling thread alone (``RowCache(threads=1)``), or the C++
passes' pool threads would escape the count. Beside it: ``process_cpu_ms``
(every thread of the process, so on the CPU it includes the device programs: the
device plan and the in-place moves) and ``wall_ms`` (until the moves end, the
evicted rows written back), medians over ``--reps`` steps per scale, the scales
timed in turn (a busy machine's drift falls on all alike); no train step runs.
Expected: ``host_cpu_ms`` flat across scales with device maps, growing with
host maps. Off the CPU the row copies of a staged move partly run on the C++
copy's threads (``native.kernels.cache_rows``), which ``host_cpu_ms`` misses
and ``process_cpu_ms`` counts.

    python bench/cache.py --preset tiny            # seconds, a check that it runs
    python bench/cache.py                          # CPU figures (~5 min on 2 cores)
    python bench/cache.py --policy-rows 20000000   # + LRU / LFU steady-state hit rates
    python bench/cache.py --policy-rows 1000000000 --policy-only --policy-algorithms lru
    python bench/cache.py --alphas 1.05 --load-factors 0.1 --warmup 1000 --algorithm lfu
    python bench/cache.py --rows 10000000 --alphas 1.05 --load-factors 0.1 --warmup 1000 \
        --algorithm lfu                            # 10 GB tables, one model at a time
    python bench/cache.py --preset gpu             # on a GPU machine
    python bench/cache.py --preset gpu --staged --alphas 1.05  # its host side, on the CPU
    python bench/cache.py --preset tiny --host-scaling         # seconds
    python bench/cache.py --host-scaling --tables 1 --hs-ids 20480 --hs-misses 2048 \
        --reps 7                                   # 1M rows, 20K..80K ids, 2048 misses
    python bench/cache.py --preset gpu --host-scaling --slot-maps device,host
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import machine, time_ms
from flax import nnx

import jaxrec as jr
from jaxrec import cache as jc
from jaxrec import checkpoint as ckpt
from jaxrec import optim, train
from jaxrec.cache import native
from jaxrec.cpu.hugepages import restart_with_huge_pages
from jaxrec.datasets.random import zipf_ids
from jaxrec.embedding import CombinedOptimizer


@dataclasses.dataclass(frozen=True)
class Config:
    T: int = 4
    E: int = 1_000_000
    D: int = 64
    B: int = 2048
    L: int = 20
    warmup: int = 40  # steps before the timed ones (the cache fills; LFU converges slowly)
    reps: int = 10
    load_factors: tuple[float, ...] = (0.05, 0.1, 0.2, 0.5, 1.0)
    alphas: tuple[float | None, ...] = (None, 0.8, 1.05, 1.2)  # None: uniform
    algorithm: str = "lru"


LARGE_BYTES = 4 << 30

PRESETS = {
    "tiny": Config(
        T=2,
        E=20_000,
        D=16,
        B=128,
        L=5,
        warmup=3,
        reps=3,
        load_factors=(0.1, 1.0),
        alphas=(None, 1.05),
    ),
    "cpu": Config(),
    "gpu": Config(
        T=4,
        E=2_000_000,
        D=128,
        B=8192,
        L=20,
        load_factors=(0.05, 0.1, 0.2, 1.0),
        alphas=(None, 1.05),
    ),
}


class Model(nnx.Module):
    def __init__(self, tables, *, rngs):
        self.ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(sum(t.embedding_dim for t in tables), 1, rngs=rngs)

    def __call__(self, kjt):
        return self.head(self.ebc(kjt).values())[:, 0]


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def configs(cfg: Config):
    return [
        jr.EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=cfg.E, embedding_dim=cfg.D, feature_names=[f"f{i}"]
        )
        for i in range(cfg.T)
    ]


def batches(cfg: Config, alpha: float | None, n: int, seed: int = 0) -> list:
    return list(stream(cfg, alpha, n, seed))


def stream(cfg: Config, alpha: float | None, n: int, seed: int = 0):
    """``n`` host batches, drawn as they are used: ``L`` ids per bag, Zipf ranks
    scattered over the rows (the same rows are hot whatever the seed)."""
    perm = np.random.default_rng(0).permutation(cfg.E)
    rng = np.random.default_rng(seed + 1)
    keys = [f"f{i}" for i in range(cfg.T)]
    for _ in range(n):
        values = perm[zipf_ids(rng, cfg.E, cfg.T * cfg.B * cfg.L, alpha)]
        lengths = np.full(cfg.T * cfg.B, cfg.L, np.int32)
        kjt = jr.KeyedJaggedTensor(
            keys, values.astype(np.int32), lengths=lengths, capacities=[cfg.B * cfg.L] * cfg.T
        )
        yield kjt, rng.normal(size=cfg.B).astype(np.float32)


def copy_rates(cfg: Config) -> dict:
    """GB/s of a random-row gather on the host and of copies between host and device
    (64 MiB of rows, medians of 5): pageable (``jax.device_put`` of a numpy array, and
    ``np.asarray`` of a device array, which adds one on-device ``+ 0`` pass so the copy
    is not cached) and pinned (:func:`pinned_rates`)."""
    rows = max(1, (64 << 20) // (cfg.D * 4))
    table = np.random.default_rng(0).random((min(cfg.E, 4 * rows), cfg.D), np.float32)
    idx = np.random.default_rng(1).integers(0, len(table), rows)
    block = table[idx]
    nbytes = block.nbytes
    dev = jax.devices()[0]
    on_device = jax.device_put(block, dev).block_until_ready()

    def gb_s(ms):
        return round(nbytes / (statistics.median(ms) * 1e-3) / 1e9, 2)

    return {
        "host_gather_GBps": gb_s(time_ms(lambda: table[idx], 5, 0)),
        "host_to_device_GBps": gb_s(
            time_ms(lambda: jax.device_put(block, dev).block_until_ready(), 5, 0)
        ),
        "device_to_host_GBps": gb_s(time_ms(lambda: np.asarray(on_device + 0), 5, 0)),
        **pinned_rates(block, dev, gb_s),
        "copy_MiB": round(nbytes / 2**20, 1),
    }


def pinned_rates(block: np.ndarray, dev, gb_s) -> dict:
    """GB/s of copies between a ``pinned_host`` array and the ``device`` memory kind
    (``jax.device_put`` to a ``SingleDeviceSharding`` of that kind, each way), the
    copies the cache's staged moves make off the CPU (``jaxrec.cache.mover._staging``).
    Null, with ``pinned_reason``, where the device lacks either kind. On the CPU both
    kinds are host memory: the figures are memcpy rates, not a link's."""
    kinds = sorted(m.kind for m in dev.addressable_memories())
    out = {
        "memory_kinds": kinds,
        "pinned_host_to_device_GBps": None,
        "device_to_pinned_host_GBps": None,
        "pinned_reason": None,
    }
    missing = [k for k in ("pinned_host", "device") if k not in kinds]
    if missing:
        out["pinned_reason"] = f"no {' / '.join(missing)} memory kind on {dev.platform}"
        return out
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    try:
        src = jax.device_put(block, pinned).block_until_ready()
        on_dev = jax.device_put(src, device).block_until_ready()
        out["pinned_host_to_device_GBps"] = gb_s(
            time_ms(lambda: jax.device_put(src, device).block_until_ready(), 5, 1)
        )
        out["device_to_pinned_host_GBps"] = gb_s(
            time_ms(lambda: jax.device_put(on_dev, pinned).block_until_ready(), 5, 1)
        )
    except Exception as e:  # noqa: BLE001 (a backend that lists the kind but cannot copy)
        out["pinned_reason"] = f"{type(e).__name__}: {e}"[:300]
    return out


def row_bytes(cache) -> dict[str, int]:
    """Bytes a move copies per row of each cached table (by name): the weight row and
    every optimizer state row (row-wise Adagrad: one float more)."""
    return {
        name: sum(a.itemsize * int(np.prod(a.shape[1:])) for a in t.host.fields.values())
        for name, t in cache.tables.items()
    }


def moved(stats, per_row: dict[str, int], steps: int) -> dict:
    """Bytes moved per step over ``steps`` steps (rows in + out, by ``CacheStats``,
    times each table's row bytes)."""
    total = sum((s.misses + s.evictions) * per_row[name] for name, s in stats.items())
    return {"row_bytes": per_row, "moved_MB_per_step": round(total / steps / 1e6, 3)}


def rate_GBps(moved_mb: float, ms: float) -> float | None:
    """The copy rate a step of ``ms`` implies for ``moved_mb`` MB moved."""
    return round(moved_mb * 1e6 / (ms * 1e-3) / 1e9, 3) if ms > 0 else None


def pipelined_ms(step, state, data, reps: int, to_device) -> float:
    """Milliseconds per step of a ``TrainPipeline`` (steps overlap their host work): the
    median time between one step's launch and the next's (in steady state the pipeline
    launches a step as the one ``depth`` back ends), as the other figures are medians.
    (A mean over the run let a few slow calls double it: the all-device pipeline of
    10M-row tables measured 18.1 ms a step, and 9.2 ms in the next run.)"""
    pipe = train.TrainPipeline(step, state, to_device=to_device)
    it = iter([data[i % len(data)] for i in range(reps + 2)])
    pipe.progress(it)[0].block_until_ready()
    stamps = [time.perf_counter()]
    while True:
        try:
            loss, _ = pipe.progress(it)
        except StopIteration:
            break
        stamps.append(time.perf_counter())
    loss.block_until_ready()
    return statistics.median(np.diff(stamps) * 1e3)


def optimizer() -> CombinedOptimizer:
    return CombinedOptimizer(optax.sgd(0.01), optim.rowwise_adagrad(0.05))


def cached_model(
    cfg: Config,
    opt,
    lf: float,
    weights: dict | None = None,
    slot_maps: str = "device",
    threads: int | None = None,
    paths: jc.MovePaths | None = None,
):
    """``(state, cache, step)``: the model with every table cached (``cfg.algorithm``,
    load factor ``lf``, the slot maps ``slot_maps``, ``threads`` planning threads, the
    move paths ``paths``), host
    tables from ``weights`` (by table name), or drawn here (large tables: drawn rather
    than copied)."""
    params = {t.name: jc.CacheParams(algorithm=cfg.algorithm, load_factor=lf) for t in configs(cfg)}
    graphdef, state = train.init_train_state(
        Model(jc.cached_configs(configs(cfg), params), rngs=nnx.Rngs(1)), opt
    )
    hosts = {
        t.name: jc.HostTable.from_arrays(t, opt.for_table(t.name), weights[t.name])
        if weights is not None
        else jc.HostTable.create(t, opt.for_table(t.name))
        for t in configs(cfg)
    }
    cache = jc.RowCache(
        graphdef, opt, state, hosts, params, slot_maps=slot_maps, threads=threads, move_paths=paths
    )
    return state, cache, jc.CachedTrainStep(train.make_train_step(graphdef, opt, loss_fn), cache)


def run_case(
    cfg, opt, weights, data, alpha, lf, slot_maps: str = "device", paths: jc.MovePaths | None = None
) -> dict:
    """One cached case: ``cfg.warmup`` steps on fresh batches, then ``data[:reps]``
    timed, then a pipelined run on ``data[reps:]`` (batches it has not seen)."""
    s2, cache, step = cached_model(cfg, opt, lf, weights, slot_maps, paths=paths)
    hosts = {name: t.host for name, t in cache.tables.items()}
    box = {"s": s2, "i": 0}

    def one(batch=None):
        box["s"], loss, _ = step(box["s"], data[box["i"]] if batch is None else batch)
        box["i"] += batch is None
        loss.block_until_ready()

    for batch in stream(cfg, alpha, cfg.warmup, seed=1):
        one(batch)
    cache.reset_stats()
    ms = time_ms(one, cfg.reps, 0)
    by_name = {n: dataclasses.replace(s) for n, s in cache.stats.items()}  # the timed steps'
    stats = list(by_name.values())
    t0 = time.perf_counter()
    prepared = cache.prepare(data[box["i"]])  # host planning alone
    prep = (time.perf_counter() - t0) * 1e3
    box["s"] = cache.load(box["s"], prepared)  # loads follow prepares in order
    pipelined = pipelined_ms(step, box["s"], data[cfg.reps + 1 :], cfg.reps, jc.prefetching(cache))
    ids = sum(s.ids for s in stats)
    floor = move_floor_ms(
        hosts, cache.tables["t0"].slots, sum(s.misses for s in stats) // (cfg.reps * cfg.T)
    )
    mv = moved(by_name, row_bytes(cache), cfg.reps)
    cached = statistics.median(ms)
    return {
        "slot_maps": slot_maps,
        "load_factor": lf,
        "slots_per_table": cache.tables["t0"].slots,
        "hit_rate": round(1 - sum(s.misses for s in stats) / ids, 4),
        "row_hit_rate": round(1 - sum(s.misses for s in stats) / sum(s.rows for s in stats), 4),
        "rows_in_per_step": sum(s.misses for s in stats) / cfg.reps,
        "rows_out_per_step": sum(s.evictions for s in stats) / cfg.reps,
        "distinct_rows_per_step": sum(s.rows for s in stats) / cfg.reps,
        "cached_step_ms": round(cached, 2),
        "pipelined_step_ms": round(pipelined, 2),
        "prepare_ms": round(prep, 2),
        "move_floor_ms": floor,
        **mv,  # beside the first line's copy rates: the rate the moves reach in a step
        "moved_GBps_at_cached_step": rate_GBps(mv["moved_MB_per_step"], cached),
        "moved_GBps_at_pipelined_step": rate_GBps(mv["moved_MB_per_step"], pipelined),
    }


def move_floor_ms(hosts, slots: int, rows: int) -> float | None:
    """Median ms of the raw copies a step's moves make, without the cache: per host
    table and field, ``rows`` random rows in (host -> random slots of a slot table)
    and ``rows`` out (random slots -> host), by the C++ row copy the moves use, through
    an L2-sized buffer. Copying at the machine's speed, the cached step can be no
    faster than the all-device step plus this. None without the extension."""
    if not native.AVAILABLE or rows <= 0:
        return None
    rng = np.random.default_rng(2)
    work = []
    for h in hosts.values():
        r = np.sort(rng.choice(h.config.num_embeddings, rows, replace=False)).astype(np.int64)
        s = np.sort(rng.choice(slots, rows, replace=False)).astype(np.int64)
        for f in h.fields.values():
            table = np.ones((slots, *f.shape[1:]), f.dtype)  # touched: no page faults timed
            work.append((f, r, table, s, np.empty((rows, *f.shape[1:]), f.dtype)))

    def run():
        for f, r, table, s, tmp in work:
            native.kernels.cache_rows(table, s, tmp, False)  # evicted rows out
            native.kernels.cache_rows(tmp, r, f, True)  # (back to the rows they came from)
            native.kernels.cache_rows(f, r, tmp, False)  # missed rows in
            native.kernels.cache_rows(tmp, s, table, True)

    run()
    return round(statistics.median(time_ms(run, 7, 1)), 2)


def scaling_kjt(cfg: Config, ids_per_table: list[np.ndarray]) -> jr.KeyedJaggedTensor:
    """One host batch: table ``t`` reads ``ids_per_table[t]`` (equal lengths) in bags of
    ``cfg.L`` ids (the last bag shorter)."""
    n = len(ids_per_table[0])
    lengths = np.full(-(-n // cfg.L), cfg.L, np.int32)
    lengths[-1] = n - cfg.L * (len(lengths) - 1)
    keys = [f"f{i}" for i in range(cfg.T)]
    values = np.concatenate(ids_per_table).astype(np.int32)
    return jr.KeyedJaggedTensor(
        keys, values, lengths=np.tile(lengths, cfg.T), capacities=[n] * cfg.T
    )


def host_scaling(
    cfg: Config,
    base: dict,
    slot_maps: list[str],
    ids: int,
    misses: int,
    scales: tuple[int, ...],
    repeats: int,
    lf: float,
    paths: jc.MovePaths | None = None,
) -> None:
    """Host CPU time of ``prepare`` + ``load`` per step at a fixed number of missed rows
    as the ids per step grow (see the module docstring): per table, ``scale * ids`` ids
    a step, of which ``misses`` rows never seen before and the rest a pool of rows
    already cached, each repeated ``repeats`` times. One JSON line per slot maps and
    scale."""
    opt = optimizer()
    perm = np.random.default_rng(7).permutation(cfg.E)
    pools = [(ids * s - misses) // repeats for s in scales]
    if min(pools) < 1:
        raise SystemExit(f"--hs-ids {ids} leaves no cached pool beside {misses} misses")
    pool = perm[: max(pools)]  # each scale's pool: its first rows
    for sm in slot_maps:
        model = cached_model(cfg, opt, lf, None, sm, threads=1, paths=paths)
        run = ScalingRun(cfg, model, perm[max(pools) :])
        slots = run.cache.tables["t0"].slots
        if max(pools) + 2 * misses > slots // 2:
            raise SystemExit(
                f"{max(pools) + 2 * misses} rows a step against {slots} slots: "
                "raise --hs-load-factor"
            )
        run.fill(max(1, slots // 4), 8)  # every miss then evicts a row
        steps = [(ids * scale, pool[:n]) for scale, n in zip(scales, pools, strict=True)]
        for k, p in steps:  # each pool loaded, each shape's programs compiled
            for _ in range(max(2, cfg.warmup // 10)):
                run.step(run.batch(p, repeats, k, misses))
        got = [[] for _ in steps]  # per scale: (times, stats) of each timed step
        for _ in range(cfg.reps):  # the scales in turn: the machine's drift spread evenly
            for g, (k, p) in zip(got, steps, strict=True):
                g.append(run.timed(p, repeats, k, misses))
        first = None
        for scale, g in zip(scales, got, strict=True):
            med = {key: round(statistics.median(t[key] for t, _ in g), 3) for key in g[0][0]}
            st = {name: jc.CacheStats() for name in run.cache.stats}
            for _, x in g:
                for name, c in x.items():
                    for f in dataclasses.fields(c):
                        setattr(st[name], f.name, getattr(st[name], f.name) + getattr(c, f.name))
            first = first or med
            mv = moved(st, row_bytes(run.cache), cfg.reps)
            n_miss = sum(x.misses for x in st.values()) / cfg.reps
            print(
                json.dumps(
                    {
                        **base,
                        "host_scaling": True,
                        "slot_maps": sm,
                        "load_factor": lf,
                        "slots_per_table": slots,
                        "tables": cfg.T,
                        "scale": scale,
                        "repeats": repeats,
                        "ids_per_table_step": ids * scale,
                        "ids_per_step": sum(x.ids for x in st.values()) / cfg.reps,
                        "distinct_rows_per_step": sum(x.rows for x in st.values()) / cfg.reps,
                        "misses_per_step": n_miss,
                        "evictions_per_step": sum(x.evictions for x in st.values()) / cfg.reps,
                        "misses_as_built": all(
                            sum(x.misses for x in s.values()) == misses * cfg.T for _, s in g
                        ),
                        "host_cpu_ms": med["cpu"],
                        "host_cpu_prepare_ms": med["cpu_prepare"],
                        "host_cpu_load_ms": med["cpu_load"],
                        "process_cpu_ms": med["process_cpu"],
                        "wall_ms": med["wall"],
                        "host_cpu_over_x1": round(med["cpu"] / first["cpu"], 3),
                        "wall_over_x1": round(med["wall"] / first["wall"], 3),
                        **mv,
                        "moved_GBps_at_wall": rate_GBps(mv["moved_MB_per_step"], med["wall"]),
                    }
                ),
                flush=True,
            )
        del run


class ScalingRun:
    """One cache of :func:`host_scaling` and its batches; ``fresh``: rows no batch has
    looked up, taken in order (the same for every table)."""

    def __init__(self, cfg: Config, model: tuple, fresh: np.ndarray):
        self.cfg, (self.state, self.cache, _), self.fresh = cfg, model, fresh
        self.rng, self.at = np.random.default_rng(8), 0

    def take(self, n: int) -> np.ndarray:
        if self.at + n > len(self.fresh):
            raise SystemExit(f"--rows {self.cfg.E}: too few rows never seen left; raise it")
        self.at += n
        return self.fresh[self.at - n : self.at]

    def step(self, batch) -> None:
        self.state = self.cache.load(self.state, self.cache.prepare(batch))

    def fill(self, rows: int, batches: int) -> None:
        """``batches`` batches of ``rows`` fresh rows: the cache full before timing."""
        for _ in range(batches):
            self.step(scaling_kjt(self.cfg, [self.take(rows)] * self.cfg.T))

    def batch(self, pool: np.ndarray, repeats: int, k: int, misses: int):
        """``k`` ids per table: each pool row ``repeats`` times, ``misses`` fresh rows,
        and pool rows again for the rounding's few ids; shuffled."""
        new = self.take(misses)
        v = np.concatenate([np.repeat(pool, repeats), new])
        v = np.concatenate([v, pool[: k - len(v)]])
        return scaling_kjt(self.cfg, [self.rng.permutation(v) for _ in range(self.cfg.T)])

    def timed(self, pool, repeats: int, k: int, misses: int) -> tuple[dict, dict]:
        """One step's ms (thread CPU of prepare, of load, of both; process CPU and wall
        until the moves end) and its ``CacheStats``."""
        cache = self.cache
        b = self.batch(pool, repeats, k, misses)  # drawn before the clocks start
        jax.block_until_ready(self.state)
        cache.write_back()
        cache.reset_stats()
        c0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
        prepared = cache.prepare(b)
        c1 = time.thread_time()
        self.state = cache.load(self.state, prepared)
        c2 = time.thread_time()
        jax.block_until_ready(self.state)
        cache.write_back()  # the moves' end (in place: the evicted rows written)
        w1, p1 = time.perf_counter(), time.process_time()
        ms = {
            "cpu_prepare": c1 - c0,
            "cpu_load": c2 - c1,
            "cpu": c2 - c0,
            "process_cpu": p1 - p0,
            "wall": w1 - w0,
        }
        return {key: v * 1e3 for key, v in ms.items()}, dict(cache.stats)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--rows", type=int, default=None, help="rows per table (default: preset)")
    p.add_argument("--tables", type=int, default=None, help="tables (default: preset)")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="cached steps before the timed ones (default: preset)",
    )
    p.add_argument(
        "--algorithm",
        choices=["lru", "lfu"],
        default=None,
        help="the cache's replacement policy (default: preset, lru)",
    )
    p.add_argument("--alphas", default=None, help="comma list; 0 = uniform (default: preset)")
    p.add_argument("--load-factors", default=None, help="comma list (default: preset)")
    p.add_argument(
        "--policy-rows",
        type=int,
        default=0,
        help="also the policies' hit rates alone, one table this large",
    )
    p.add_argument(
        "--policy-batches",
        type=int,
        default=60,
        help="batches per policy run (the last third counted)",
    )
    p.add_argument("--policy-algorithms", default="lru,lfu")
    p.add_argument(
        "--staged",
        action="store_true",
        help="moves staged in pinned host memory, as off the CPU (the GPU "
        "path's host side, timed on the CPU)",
    )
    p.add_argument(
        "--slot-maps",
        default=None,
        help="RowCache(slot_maps=...): device (planned by one device program, "
        "the default), host (the C++ planner), or a comma list of both "
        "(default: device; with --host-scaling, device,host)",
    )
    p.add_argument(
        "--host-scaling",
        action="store_true",
        help="only the host CPU time of prepare + load at fixed misses as the "
        "ids per step grow (see the module docstring)",
    )
    p.add_argument(
        "--hs-ids",
        type=int,
        default=None,
        help="ids per table per step at scale 1 (default: preset B * L)",
    )
    p.add_argument(
        "--hs-misses",
        type=int,
        default=None,
        help="missed rows per table per step (default: a tenth of --hs-ids)",
    )
    p.add_argument("--hs-scales", default="1,2,4", help="multiples of --hs-ids")
    p.add_argument("--hs-repeats", type=int, default=4, help="ids per cached pool row per step")
    p.add_argument("--hs-load-factor", type=float, default=0.1)
    p.add_argument(
        "--policy-only", action="store_true", help="only the policies' hit rates (no training)"
    )
    return p.parse_args(argv)


def policy_hit_rates(
    rows: int,
    cfg: Config,
    base: dict,
    batches: int = 60,
    algorithms: tuple[str, ...] = ("lru", "lfu"),
) -> None:
    """Steady-state hit rates of the replacement policies alone (``SlotMap``, the
    cache's own bookkeeping, no tables) on one table of ``rows`` rows: ``batches``
    batches of at least a fifth of the slots, the last third counted (a big cache
    warms slowly: at the bench's batch size it would take thousands of steps). Beside
    each, the law's own figures (``cache_model``): Che's approximation of LRU and the
    hit rate of the most frequent rows (where LFU's counts converge). Ranks are not
    scattered over the rows: a fully associative cache does not see where rows lie.
    Batches are drawn as they run, so 10^9 rows take ~10 GB (the map and the slots)."""
    from cache_model import lru_hit_rate, top_rows_hit_rate

    from jaxrec.cache.slots import SlotMap

    for alpha in [a for a in cfg.alphas if a]:
        for lf in [x for x in cfg.load_factors if x < 1]:
            slots = max(1, int(lf * rows))
            n = max(cfg.B * cfg.L, slots // 5)
            model = {
                "lru_che": round(lru_hit_rate(rows, slots, alpha), 4),
                "top_rows": round(top_rows_hit_rate(rows, slots, alpha), 4),
            }
            for algorithm in algorithms:
                rng = np.random.default_rng(1)  # the same ids for each policy
                m = SlotMap(rows, slots, jc.CacheAlgorithm(algorithm))
                ids = misses = 0
                t0 = time.perf_counter()
                for i in range(batches):
                    v = zipf_ids(rng, rows, n, alpha).astype(np.int32)
                    a = m.assign(m.plan([v], "policy"))
                    m.touch(v, np.empty_like(v), 0)
                    if i >= batches - batches // 3:
                        ids, misses = ids + len(v), misses + len(a.fill_rows)
                del m
                print(
                    json.dumps(
                        {
                            **base,
                            "policy_only": True,
                            "rows": rows,
                            "alpha": alpha,
                            "algorithm": algorithm,
                            "load_factor": lf,
                            "ids_per_batch": n,
                            "batches": batches,
                            "hit_rate": round(1 - misses / ids, 4),
                            **model,
                            "seconds": round(time.perf_counter() - t0, 1),
                        }
                    ),
                    flush=True,
                )


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = PRESETS[a.preset]
    if a.reps:
        cfg = dataclasses.replace(cfg, reps=a.reps)
    if a.rows:
        cfg = dataclasses.replace(cfg, E=a.rows)
    if a.tables:
        cfg = dataclasses.replace(cfg, T=a.tables)
    if a.warmup is not None:
        cfg = dataclasses.replace(cfg, warmup=a.warmup)
    if a.algorithm:
        cfg = dataclasses.replace(cfg, algorithm=a.algorithm)
    if a.alphas:
        cfg = dataclasses.replace(
            cfg, alphas=tuple(None if float(x) == 0 else float(x) for x in a.alphas.split(","))
        )
    if a.load_factors:
        cfg = dataclasses.replace(cfg, load_factors=tuple(map(float, a.load_factors.split(","))))
    paths = jc.MovePaths(inplace=False, pinned=True) if a.staged else None
    slot_maps = (a.slot_maps or ("device,host" if a.host_scaling else "device")).split(",")
    if any(x not in ("device", "host") for x in slot_maps):
        raise SystemExit(f"--slot-maps: device, host or both, got {a.slot_maps!r}")
    dev = jax.devices()[0]
    base = {
        "bench": "cache",
        "preset": a.preset,
        "date": datetime.date.today().isoformat(),
        "device": dev.device_kind,
        "platform": dev.platform,
        **machine(),
        "config": dataclasses.asdict(cfg),
        "staged": a.staged,
        "slot_maps": ",".join(slot_maps),  # each case line: its own
    }
    print(json.dumps({**base, "copy": copy_rates(cfg)}), flush=True)
    if a.host_scaling:
        ids = a.hs_ids or cfg.B * cfg.L
        host_scaling(
            cfg,
            base,
            slot_maps,
            ids,
            a.hs_misses or max(1, ids // 10),
            tuple(int(x) for x in a.hs_scales.split(",")),
            a.hs_repeats,
            a.hs_load_factor,
            paths,
        )
        return 0
    if a.policy_rows:
        policy_hit_rates(
            a.policy_rows, cfg, base, a.policy_batches, tuple(a.policy_algorithms.split(","))
        )
    if a.policy_only:
        return 0
    opt = optimizer()
    graphdef, state = train.init_train_state(Model(configs(cfg), rngs=nnx.Rngs(1)), opt)
    # Large tables (over LARGE_BYTES of weights): one copy of them at a time. The
    # all-device model trains on its only state and is freed before the cached one,
    # whose host tables are drawn afresh (other values: the times do not depend on them).
    large = cfg.T * cfg.E * cfg.D * 4 > LARGE_BYTES
    if large and len(cfg.alphas) != 1:
        raise SystemExit(f"tables over {LARGE_BYTES >> 30} GiB: one --alphas at a time")
    state0 = state if large else jax.tree.map(jnp.copy, state)
    weights = None
    if not large:
        logical = ckpt.logical_state(graphdef, opt, state0).tables
        weights = {t.name: logical[f"ebc.embedding_bags.{t.name}"]["weight"] for t in configs(cfg)}
        del logical
    del state
    full = train.make_train_step(graphdef, opt, loss_fn)
    for alpha in cfg.alphas:
        data = batches(cfg, alpha, 2 * cfg.reps + 3)
        box = {"s": state0 if large else jax.tree.map(jnp.copy, state0), "i": 0}
        if large:
            del state0

        def one(box=box, data=data):
            box["s"], loss, _ = full(box["s"], data[box["i"] % len(data)])
            box["i"] += 1
            loss.block_until_ready()

        device_ms = statistics.median(time_ms(one, cfg.reps, 3))
        device_pipelined = pipelined_ms(full, box["s"], data, cfg.reps, jax.device_put)
        del box, one
        for lf, sm in [(lf, sm) for lf in cfg.load_factors for sm in slot_maps]:
            r = run_case(cfg, opt, weights, data, alpha, lf, sm, paths)
            r.update(
                alpha=alpha or "uniform",
                device_step_ms=round(device_ms, 2),
                device_pipelined_step_ms=round(device_pipelined, 2),
                cached_over_device=round(r["cached_step_ms"] / device_ms, 3),
                pipelined_over_device=round(r["pipelined_step_ms"] / device_pipelined, 3),
                pipelined_stat="median",  # of the intervals between steps (a mean before)
            )
            print(json.dumps({**base, **r}), flush=True)
    return 0


if __name__ == "__main__":
    # The all-device reference at its best: its tables on huge pages from the start.
    restart_with_huge_pages()
    sys.exit(main())
