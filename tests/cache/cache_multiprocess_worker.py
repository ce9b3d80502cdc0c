"""One process of the two-process cache test (see ``test_cache_multiprocess.py``).

Run as ``python cache_multiprocess_worker.py <process_id> <port>`` in two processes on
one machine: each owns 2 CPU devices (gloo collectives), the 4 form one mesh ``("x",)``.
``big`` is row-wise over all 4 (two shards per process), ``mean`` table-wise on rank 2
(process 1), both cached; each process holds only its own shards' host rows. Every
process trains, side by side on the same batches (each passing its own devices' part):

1. the model with every table in device memory (the reference),
2. the cached model, each batch prepared right before its step,
3. the cached model in a ``TrainPipeline`` that prepares two batches ahead, its
   rows staged in pinned host memory (the path off the CPU), flushed halfway with
   batches prefetched (its host rows then equal the reference's at that step),

and checks: the losses equal the reference's at every step; after a flush, each
process's host rows equal the reference's tables at those rows; a host field replaced
on process 1 refuses the next batch on both processes, after which training goes on
exactly, as it does after a batch whose ids from process 0 overfill a shard that process
1 owns (both refuse it); a checkpoint saved from the cache (each process writing its own host rows)
restores into the all-device model as the reference's tables, and into the pipelined
cached model, which then trains on as the reference does. Prints one JSON line;
exits 1 on a mismatch.
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402
from cache_cases import (  # noqa: E402
    CACHED,
    KEYS,
    MAX_LEN,
    build,
    configs,
    fused,
    local_batch,
    logical_plan,
    loss_fn,
    optimizer,
)
from jax.experimental import multihost_utils  # noqa: E402

import jaxrec as jr  # noqa: E402
from jaxrec import cache as jc  # noqa: E402
from jaxrec import checkpoint as ckpt  # noqa: E402
from jaxrec import distributed as d  # noqa: E402
from jaxrec import optim, train  # noqa: E402

WORLD, LOCAL = 4, 2
STEPS = 8
GLOO_UNAVAILABLE = 77
GENS = {"big": d.row_wise(), "mean": d.table_wise(2), "small": d.table_wise(0)}


def crowded(device: int, n: int = 3):
    """A local batch whose ``a`` and ``b`` ids are 2 * n * MAX_LEN distinct rows of big's
    last row shard (rows 150..199; 36 over two devices, the shard has 30 slots)."""
    first = 150 + 2 * n * MAX_LEN * device
    values = list(range(first, first + 2 * n * MAX_LEN))
    values += [0] * (n * MAX_LEN) + [0] * (n * MAX_LEN)  # m, s
    kjt = jr.KeyedJaggedTensor.from_lengths_sync(
        KEYS, values, [MAX_LEN] * (len(KEYS) * n), capacities={k: MAX_LEN * n for k in KEYS}
    )
    return kjt, np.zeros(n, np.float32)


def tables(graphdef, state) -> dict[str, np.ndarray]:
    ebc = train.merge_model(graphdef, state).ebc
    return {k.split(".")[-2]: np.asarray(v) for k, v in ebc.state_dict().items()}


def main(process_id: int, port: int, directory: str) -> int:
    try:
        jax.distributed.initialize(
            f"127.0.0.1:{port}",
            num_processes=2,
            process_id=process_id,
            local_device_ids=list(range(LOCAL)),
        )
    except Exception as e:
        if "gloo" in str(e).lower():
            print(f"gloo CPU collectives unavailable: {e}", flush=True)
            return GLOO_UNAVAILABLE
        raise
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    mine = [i for i, dev in enumerate(mesh.devices.flat) if dev.process_index == process_id]
    opt = optimizer(optim.rowwise_adagrad(0.3))
    params = {t: jc.CacheParams(load_factor=0.6) for t in CACHED}
    plan = logical_plan(GENS, mesh, params)
    graphdef, state = build(opt, plan=fused(plan), mesh=mesh)
    start = tables(graphdef, state)
    step = train.make_train_step(graphdef, opt, loss_fn)

    def cached(paths=None):
        slot_configs, slot_plan = jc.device_plan(configs(), plan)
        g2, s2 = build(opt, slot_configs, slot_plan, mesh)
        for name, w in tables(g2, s2).items():  # what is not cached starts alike
            if name not in CACHED:
                assert np.array_equal(w, start[name]), name
        hosts = {}
        for c in configs():
            if c.name in CACHED:
                lo, hi = jc.host_rows(g2, opt, s2, c)
                w = start[c.name][lo:hi]
                hosts[c.name] = jc.HostTable.from_arrays(c, opt.for_table(c.name), w, rows=(lo, hi))
        cache = jc.RowCache(g2, opt, s2, hosts, params, timeout_s=60, move_paths=paths)
        cstep = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn), cache)
        return s2, cache, cstep

    s_a, cache_a, step_a = cached()
    # the pipelined one stages in pinned host memory, as on GPUs
    s_b, cache_b, step_b = cached(jc.MovePaths(pinned=True))
    assert cache_a._mover.staging is None and cache_b._mover.staging is not None
    rng = np.random.default_rng(1)
    batches = [[local_batch(rng, 3) for _ in range(WORLD)] for _ in range(STEPS)]
    ref, got_a, mid = [], [], STEPS // 2
    for local in batches:
        state, loss, _ = step(state, d.shard_batch([local[i] for i in mine], mesh))
        ref.append(float(loss))
        if len(ref) == mid:
            want_mid = tables(graphdef, state)
        p = cache_a.prepare([local[i] for i in mine])
        s_a, loss, _ = step_a(s_a, p._replace(batch=d.shard_batch(p.batch, mesh)))
        got_a.append(float(loss))
    pipe = train.TrainPipeline(
        step_b, s_b, depth=2, to_device=jc.prefetching(cache_b, lambda b: d.shard_batch(b, mesh))
    )
    it = iter([[local[i] for i in mine] for local in batches])
    got_b, diffs = [], {}
    for _ in batches:
        got_b.append(float(pipe.progress(it)[0]))
        if len(got_b) == mid:  # batches prefetched: the flush copies what the devices hold
            assert cache_b._prepared > cache_b._loaded
            cache_b.flush(pipe.state)  # only read: the pipeline goes on with its state
            for name in CACHED:
                host = cache_b.tables[name].host
                lo, hi = host.rows
                diffs[f"b.mid.{name}"] = float(
                    np.max(np.abs(host.fields["weight"] - want_mid[name][lo:hi]), initial=0)
                )
    s_b = pipe.state
    want_b = tables(graphdef, state)  # after the same batches

    # a host field replaced on process 1: both refuse the batch, nothing changes
    refused = []
    local = [local_batch(rng, 3) for _ in range(WORLD)]
    held = cache_a.tables["big"].host.fields["weight"]
    if process_id == 1:
        cache_a.tables["big"].host.fields["weight"] = held[:, :4].copy()
    try:
        cache_a.prepare([local[i] for i in mine])
    except ValueError as e:
        refused.append(str(e)[:200])
    cache_a.tables["big"].host.fields["weight"] = held
    # process 0's ids crowd big's last shard (owned by process 1): both refuse the batch,
    # as a too-small cache on both (callers may catch it to shrink their batches)
    try:
        cache_a.prepare(
            [crowded(i) if process_id == 0 else local_batch(rng, 3) for i in range(LOCAL)]
        )
    except jc.CacheTooSmallError as e:
        refused.append(str(e)[:200])
    state, loss, _ = step(state, d.shard_batch([local[i] for i in mine], mesh))
    ref.append(float(loss))
    p = cache_a.prepare([local[i] for i in mine])
    s_a, loss, _ = step_a(s_a, p._replace(batch=d.shard_batch(p.batch, mesh)))
    got_a.append(float(loss))
    want = tables(graphdef, state)

    # a checkpoint: each process writes its own host rows; it holds the logical tables
    mgr = ckpt.CheckpointManager(directory, async_save=False)
    s_a = cache_a.save(mgr, 1, s_a)
    _, fresh = build(opt, plan=fused(plan), mesh=mesh)
    restored = tables(graphdef, mgr.restore(graphdef, opt, fresh, step=1))
    diffs |= {f"restored.{k}": float(np.max(np.abs(restored[k] - want[k]))) for k in want}
    s_b = cache_b.flush(s_b)
    for run, cache, w in (("a", cache_a, want), ("b", cache_b, want_b)):
        for name in CACHED:
            host = cache.tables[name].host
            lo, hi = host.rows
            diffs[f"{run}.{name}[{lo}:{hi}]"] = float(
                np.max(np.abs(host.fields["weight"] - w[name][lo:hi]), initial=0)
            )
    # the pipelined model restores the checkpoint and trains on as the reference does
    for name in CACHED:  # (its host rows zeroed first: the restore must fill them)
        cache_b.tables[name].host.fields["weight"][:] = 0
    s_b = cache_b.restore(mgr, s_b, step=1)
    for name in CACHED:
        host = cache_b.tables[name].host
        lo, hi = host.rows
        diffs[f"b.restored.{name}"] = float(
            np.max(np.abs(host.fields["weight"] - want[name][lo:hi]), initial=0)
        )
    local = [local_batch(rng, 3) for _ in range(WORLD)]
    state, loss, _ = step(state, d.shard_batch([local[i] for i in mine], mesh))
    p = cache_b.prepare([local[i] for i in mine])
    s_b, loss_b, _ = step_b(s_b, p._replace(batch=d.shard_batch(p.batch, mesh)))
    after_restore = [float(loss), float(loss_b)]
    mgr.close()
    for c in (cache_a, cache_b):  # the job's end: connections closed, prepare refused
        c.close()
    closed = False
    try:
        cache_a.prepare([local[i] for i in mine])
    except RuntimeError as e:
        closed = "was closed" in str(e)
    # each process plans (and counts) only the shards it owns
    stats = {t: [cache_a.stats[t].misses, cache_a.stats[t].evictions] for t in CACHED}
    owns = {t: [m is not None for m in cache_a.tables[t].maps] for t in CACHED}
    ok = (
        got_a == ref
        and got_b == ref[:STEPS]
        and all(v == 0 for v in diffs.values())
        and len(refused) == 2
        and closed
        and after_restore[0] == after_restore[1]
        and all((m > 0 and e > 0) == any(owns[t]) for t, (m, e) in stats.items())
    )
    rows = {t: list(cache_a.tables[t].host.rows) for t in CACHED}
    report = {
        "process": process_id,
        "ok": ok,
        "losses": ref,
        "prepared": got_a,
        "pipelined": got_b,
        "max_abs_diff": diffs,
        "refused": refused,
        "after_restore": after_restore,
        "stats": stats,
        "rows": rows,
        "owns": owns,
    }
    print(json.dumps(report), flush=True)
    multihost_utils.sync_global_devices("done")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
