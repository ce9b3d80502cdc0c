"""One process of the two-process sharding test (see ``test_multiprocess.py``).

Run as ``python multiprocess_worker.py <process_id> <port>`` in two processes
on one machine: each owns 2 CPU devices, gloo carries the collectives, and
the 4 devices form one global mesh ``("x",)`` (ranks 0-1 on process 0, 2-3 on
process 1). Every process:

1. builds ``sharding_cases.Model`` from its constructor with its EBC sharded
   (row-wise, table-wise, column-wise and data-parallel tables) over the global
   mesh by ``DistributedModelParallel`` (each device draws its own shards),
   checks its tables and dense params equal the eager build's bit for bit, and
   trains ``STEPS`` steps; each process places only its own devices' local
   batches with ``shard_batch``;
2. trains the unsharded model on the full global batch (every process
   generates all of it from the same seed) on its first local device;
3. prints the largest differences (losses, tables, dense params) as one JSON
   line and exits 1 if any exceeds ``TOL``.

Each process passes only its own devices' batches to ``shard_batch`` and
reads the logical tables with ``state_dict()`` (gathered across processes).

Exit code 77 means gloo CPU collectives are unavailable in this jaxlib.
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from sharding_cases import CAP, Model, batches, loss_fn  # noqa: E402

from jaxrec import distributed as d  # noqa: E402
from jaxrec import optim, train  # noqa: E402
from jaxrec.embedding import CombinedOptimizer  # noqa: E402
from jaxrec.sparse import KeyedJaggedTensor  # noqa: E402

NUM_PROCESSES = 2
LOCAL_DEVICES = 2
WORLD = NUM_PROCESSES * LOCAL_DEVICES
STEPS = 2
TOL = 1e-5
GLOO_UNAVAILABLE = 77
PLAN = {
    "t1": d.row_wise(),  # 50 rows over all 4 ranks, both processes
    "t2": d.table_wise(2),  # on process 1
    "t3": d.column_wise([1, 2]),  # one column block per process
    "t4": d.data_parallel(),
}


def optimizer():
    return CombinedOptimizer(optax.adam(0.01), optim.adam(0.05))


def fixed_capacity(batch, capacity: int):
    """The global batch with every key's capacity fixed: one compilation for all steps."""
    kjt, y = batch
    values = np.asarray(kjt.values())
    starts, per_key = kjt.capacity_offsets(), np.asarray(kjt.length_per_key())
    packed = np.concatenate(  # each key's valid ids, without its padding
        [values[s : s + n] for s, n in zip(starts[:-1], per_key, strict=True)]
    )
    fixed = KeyedJaggedTensor.from_lengths_sync(
        kjt.keys(), packed, np.asarray(kjt.lengths()), capacities=[capacity] * len(kjt.keys())
    )
    return fixed, y


def dense_params(model) -> list[np.ndarray]:
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in leaves]


def main(process_id: int, port: int) -> int:
    try:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=NUM_PROCESSES,
            process_id=process_id,
            local_device_ids=list(range(LOCAL_DEVICES)),
        )
        devices = jax.devices()
    except Exception as e:
        if "gloo" in str(e).lower():
            print(f"gloo CPU collectives unavailable: {e}", flush=True)
            return GLOO_UNAVAILABLE
        raise
    assert len(devices) == WORLD and jax.local_device_count() == LOCAL_DEVICES, devices
    # Ranks are the mesh's flat device order: this process's devices are contiguous.
    mesh = jax.sharding.Mesh(np.array(devices), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    mine = [i for i, dev in enumerate(mesh.devices.flat) if dev.process_index == process_id]

    # Sharded: built from the constructor (each device draws its own shards), then
    # trained; only this process's local batches are placed.
    rng = np.random.default_rng(0)
    eager = Model(rngs=nnx.Rngs(1))
    plan = d.ShardingPlan(
        {"ebc": d.construct_module_sharding_plan(eager.ebc, PLAN, world_size=WORLD)}
    )
    model = d.DistributedModelParallel(lambda: Model(rngs=nnx.Rngs(1)), plan, mesh)
    built = {k: np.asarray(v) for k, v in model.ebc.state_dict().items()}
    drawn_as_eager = all(
        np.array_equal(built[k], np.asarray(v)) for k, v in eager.ebc.state_dict().items()
    ) and all(
        np.array_equal(a, np.asarray(b))
        for a, b in zip(
            dense_params(model), jax.tree.leaves(nnx.state(eager, nnx.Param)), strict=True
        )
    )
    opt = optimizer()
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    losses, globals_ = [], []
    for _ in range(STEPS):
        local, glob = batches(rng, world=WORLD)
        globals_.append(fixed_capacity(glob, WORLD * CAP))
        state, loss, _ = step(state, d.shard_batch([local[i] for i in mine], mesh))
        losses.append(float(loss))  # the loss is replicated: every process can read it
    sharded = train.merge_model(graphdef, state)
    tables = {k: np.asarray(v) for k, v in sharded.ebc.state_dict().items()}
    params = dense_params(sharded)

    # Unsharded, on the global batches, on this process's first device.
    with jax.default_device(jax.local_devices()[0]):
        opt = optimizer()
        graphdef, state = train.init_train_state(Model(rngs=nnx.Rngs(1)), opt)
        step = train.make_train_step(graphdef, opt, loss_fn)
        ref_losses = []
        for glob in globals_:
            state, loss, _ = step(state, glob)
            ref_losses.append(float(loss))
        ref = train.merge_model(graphdef, state)
        ref_tables = {k: np.asarray(v) for k, v in ref.ebc.state_dict().items()}
        ref_params = [np.asarray(x) for x in jax.tree.leaves(nnx.state(ref, nnx.Param))]

    diffs = {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        **{k: float(np.max(np.abs(tables[k] - ref_tables[k]))) for k in ref_tables},
        "dense_params": max(
            float(np.max(np.abs(a - b))) for a, b in zip(params, ref_params, strict=True)
        ),
    }
    ok = drawn_as_eager and all(v <= TOL for v in diffs.values())
    report = {
        "process": process_id,
        "losses": losses,
        "max_abs_diff": diffs,
        "drawn_as_eager": drawn_as_eager,
        "ok": ok,
    }
    print(json.dumps(report), flush=True)
    multihost_utils.sync_global_devices("done")  # neither process leaves the other mid-collective
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
