"""One process of the two-process checkpoint test (see ``test_checkpoint_multiprocess.py``).

Run as ``python checkpoint_worker.py <process_id> <port> <directory>`` in two
processes: each owns 2 CPU devices and gloo joins them into one 4-device mesh.
Every process:

1. shards ``sharding_cases.Model`` over the mesh (a table row-wise over both
   processes, one table-wise on process 1, one column-wise across them, one
   data-parallel), sets every value of its train state to ``init + 3`` and
   saves it with ``CheckpointManager`` into the shared directory;
2. restores it into the same plan (every process placing its own shards)
   and into an unsharded model on its first local device;
3. compares each restored logical state with the unsharded model's state
   changed the same way (exact);
4. saves step 2, has process 0 flip a bit in a table only process 1 reads, and
   resumes: both processes skip step 2 (process 1 finds the damage, process 0
   learns it from the agreement) and restore step 1 exactly;

and prints one JSON line, exiting 1 on a mismatch.

Exit code 77 means gloo CPU collectives are unavailable in this jaxlib.
"""

from __future__ import annotations

import glob
import json
import sys
import warnings

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from checkpoint_cases import Model, host  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxrec import checkpoint as ckpt  # noqa: E402
from jaxrec import distributed as d  # noqa: E402
from jaxrec import optim, train  # noqa: E402
from jaxrec.embedding import CombinedOptimizer  # noqa: E402

WORLD = 4
GLOO_UNAVAILABLE = 77
MIXED = {
    "t1": d.row_wise(),
    "t2": d.table_wise(2),
    "t3": d.column_wise([1, 2]),
    "t4": d.data_parallel(),
}


def build(opt, gens, mesh):
    model = Model(rngs=nnx.Rngs(1))
    if gens is not None:
        plan = d.construct_module_sharding_plan(model.ebc, gens, world_size=WORLD)
        model = d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh)
    return train.init_train_state(model, opt)


def main(process_id: int, port: int, directory: str) -> int:
    try:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=2,
            process_id=process_id,
            local_device_ids=[0, 1],
        )
        devices = jax.devices()
    except Exception as e:
        if "gloo" in str(e).lower():
            print(f"gloo CPU collectives unavailable: {e}", flush=True)
            return GLOO_UNAVAILABLE
        raise
    mesh = jax.sharding.Mesh(np.array(devices), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    opt = CombinedOptimizer(optax.adam(0.01), optim.partial_rowwise_adam(0.05))
    bump = lambda state: jax.tree.map(lambda x: x + 3, state)

    graphdef, state = build(opt, MIXED, mesh)
    with ckpt.CheckpointManager(directory) as mgr:  # async: written in the background
        mgr.save(1, graphdef, opt, bump(state))

    with jax.default_device(jax.local_devices()[0]):  # the expected values, unsharded
        ref_graphdef, ref = build(opt, None, None)
        expected = host(ckpt.logical_state(ref_graphdef, opt, bump(ref)))

    results = {}
    with ckpt.CheckpointManager(directory) as mgr:
        for name, gens in (("mixed", MIXED), ("unsharded", None)):
            with jax.default_device(jax.local_devices()[0]):
                graphdef, target = build(opt, gens, mesh)
                got = host(ckpt.logical_state(graphdef, opt, mgr.restore(graphdef, opt, target)))
            same = sorted(got) == sorted(expected)
            results[name] = same and all(np.array_equal(got[k], expected[k]) for k in expected)
    # Step 2 damaged where only process 1 reads (t2 lives on rank 2, a device of
    # process 1): both processes must skip it together and resume step 1.
    graphdef, state = build(opt, MIXED, mesh)
    with ckpt.CheckpointManager(directory) as mgr:
        mgr.save(2, graphdef, opt, jax.tree.map(lambda x: x + 4, state))
    multihost_utils.sync_global_devices("saved 2")
    if process_id == 0:
        with open(f"{directory}/2/meta.json") as f:
            t2 = json.load(f)["meta"]["tables"]["ebc.embedding_bags.t2"]["id"]
        chunk = sorted(glob.glob(f"{directory}/2/tables/{t2}/weight/*/c/*/*"))[0]
        with open(chunk, "r+b") as f:
            f.seek(3)
            byte = f.read(1)[0]
            f.seek(3)
            f.write(bytes([byte ^ 1]))
    multihost_utils.sync_global_devices("damaged 2")
    with jax.default_device(jax.local_devices()[0]):
        graphdef, target = build(opt, MIXED, mesh)
    with ckpt.CheckpointManager(directory) as mgr, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed, step = mgr.resume(graphdef, opt, target)
    got = host(ckpt.logical_state(graphdef, opt, resumed))
    results["resume"] = step == 1 and all(np.array_equal(got[k], expected[k]) for k in expected)
    skipped = [
        str(w.message) for w in caught if "skipping damaged checkpoint step 2" in str(w.message)
    ]
    results["warned"] = len(skipped) == 1
    report = {
        "process": process_id,
        "equal": results,
        "ok": all(results.values()),
        "resumed": step,
        "warning": skipped[:1],
    }
    print(json.dumps(report), flush=True)
    multihost_utils.sync_global_devices("done")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
