"""How long ``RowCache.prepare`` takes when the shards are planned by their owners.

A model of ``T`` cached tables, row-wise over 4 CPU devices, Zipf ids. Each process
times ``prepare`` of its part of the same global batches (median of ``--reps`` after
``--warmup``), run two ways: one process holding all 4 devices (it plans every shard
on the whole batch), and two processes of 2 devices each (each plans its own 2 shards
on both processes' ids of them, after exchanging ids and slots: ``owned.py``). Moves
are staged (as off the CPU) in both, so ``prepare`` includes gathering the missed rows.
Prints one JSON line per process and setup (the machine named): the wall time and the
CPU time (all of the process's threads) of a ``prepare``. On a 2-core machine the two
processes share the cores, so the CPU time is the figure that shows the split.

    python bench/cache_planning.py [--rows 1000000] [--reps 20]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 4


def worker(process_id: int, n_proc: int, port: int, a: argparse.Namespace) -> None:
    import jax

    local = WORLD // n_proc
    jax.config.update("jax_num_cpu_devices", local)
    if n_proc > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            f"127.0.0.1:{port}",
            num_processes=n_proc,
            process_id=process_id,
            local_device_ids=list(range(local)),
        )
    import dataclasses
    import statistics
    import time

    import numpy as np
    import optax
    from common import machine
    from flax import nnx

    import jaxrec as jr
    from jaxrec import cache as jc
    from jaxrec import distributed as d
    from jaxrec import optim, train
    from jaxrec.datasets.random import zipf_ids
    from jaxrec.embedding import CombinedOptimizer

    configs = [
        jr.EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=a.rows, embedding_dim=a.dim, feature_names=[f"f{i}"]
        )
        for i in range(a.tables)
    ]
    keys = [f"f{i}" for i in range(a.tables)]

    class Model(nnx.Module):
        def __init__(self, tables):
            self.ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    opt = CombinedOptimizer(optax.sgd(0.01), optim.rowwise_adagrad(0.05))
    params = {c.name: jc.CacheParams(algorithm=a.algorithm, load_factor=0.1) for c in configs}
    plan = d.construct_module_sharding_plan(
        Model(configs).ebc, {c.name: d.row_wise() for c in configs}, world_size=WORLD
    )
    for name, p in params.items():
        plan[name] = dataclasses.replace(
            plan[name], compute_kernel=d.EmbeddingComputeKernel.FUSED_UVM_CACHING, cache_params=p
        )
    slot_configs, slot_plan = jc.device_plan(configs, plan)
    model = d.DistributedModelParallel(
        Model(slot_configs), d.ShardingPlan({"ebc": slot_plan}), mesh
    )
    graphdef, state = train.init_train_state(model, opt)
    hosts = {
        c.name: jc.HostTable.create(
            c, opt.for_table(c.name), rows=jc.host_rows(graphdef, opt, state, c)
        )
        for c in configs
    }
    # the host's maps in one process too: the owned planning of several is what is timed
    staged = jc.MovePaths(inplace=False)  # in both setups (in place is one process's)
    cache = jc.RowCache(
        graphdef, opt, state, hosts, params, timeout_s=120, slot_maps="host", move_paths=staged
    )
    perm = np.random.default_rng(0).permutation(a.rows)
    mine = [i for i, dev in enumerate(mesh.devices.flat) if dev.process_index == process_id]

    def device_batch(step: int, device: int):  # the same global batch in both setups
        rng = np.random.default_rng([step, device])
        values = perm[zipf_ids(rng, a.rows, a.tables * a.batch * a.bag, a.alpha)]
        return jr.KeyedJaggedTensor(
            keys,
            values.astype(np.int32),
            lengths=np.full(a.tables * a.batch, a.bag, np.int32),
            capacities=[a.batch * a.bag] * a.tables,
        )

    ms, cpu = [], []
    for step in range(a.warmup + a.reps):
        parts = [device_batch(step, i) for i in mine]
        t0, c0 = time.perf_counter(), time.process_time()
        cache.prepare(parts)
        ms.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
        if len(cache._inflight) > 200:  # nothing is loaded here: forget their evictions
            cache._inflight.release(cache._prepared)
    st = cache.stats
    out = {
        "bench": "cache_planning",
        "date": datetime.date.today().isoformat(),
        **machine(),
        "processes": n_proc,
        "process": process_id,
        "devices_per_process": len(mine),
        "config": {k: v for k, v in vars(a).items() if k != "worker"},
        "global_ids_per_step": WORLD * a.tables * a.batch * a.bag,
        "shards_planned": sum(m is not None for t in cache.tables.values() for m in t.maps),
        "prepare_ms": round(statistics.median(ms[a.warmup :]), 2),
        "prepare_cpu_ms": round(statistics.median(cpu[a.warmup :]), 2),  # all its threads
        "planned_misses_per_step": sum(s.misses for s in st.values()) // (a.warmup + a.reps),
    }
    cache.close()
    print(json.dumps(out), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(n_proc: int, argv: list[str]) -> int:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.dirname(HERE), HERE, env.get("PYTHONPATH")])
    )
    # each worker's own pipe, printed here whole: workers sharing this stdout interleave
    # their lines when Python writes unbuffered (PYTHONUNBUFFERED: text, then "\n")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", f"{i},{n_proc},{port}", *argv],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(n_proc)
    ]
    for p in procs:
        sys.stdout.write(p.communicate(timeout=1800)[0])
    sys.stdout.flush()
    return max(p.returncode for p in procs)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=2048, help="samples per device")
    p.add_argument("--bag", type=int, default=20)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--algorithm", choices=["lru", "lfu"], default="lru")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> int:
    a = parse()
    if a.worker:
        i, n, port = map(int, a.worker.split(","))
        worker(i, n, port, a)
        return 0
    return max(run(1, sys.argv[1:]), run(2, sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
