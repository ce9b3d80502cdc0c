"""Peak host memory of checkpoint saves and restores (see ``test_checkpoint_memory.py``).

``python memory_worker.py <directory> <megabytes>`` builds a model of four tables
(about ``megabytes`` of weights and row-wise Adagrad state) sharded over 8 CPU
devices (row-wise, column-wise, table-wise), then measures, as growth of the
process's peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``)
over the memory held before each operation:

- ``save``: a synchronous save with a 16 MiB staging buffer;
- ``async_save``: an asynchronous save (its host copy of the pieces included;
  ``logical_bytes``: the tables and state unpadded);
- ``restore``: a restore into another plan (every table row-wise), whose new
  arrays (``restored_bytes``) are counted;

and prints one JSON line with those and the state's size. Values are checked too.
On CPU the devices' memory is the process's memory.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import gc  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxrec as jr  # noqa: E402
from jaxrec import checkpoint as ckpt  # noqa: E402
from jaxrec import distributed as d  # noqa: E402
from jaxrec import optim, train  # noqa: E402
from jaxrec.embedding import CombinedOptimizer  # noqa: E402

STAGING = 16 << 20
OPT = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.1))


def _kb(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> int:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _kb("VmRSS")


def _shapes(rows: int) -> list[tuple[int, int]]:
    return [(rows, 64), (rows, 64), (rows // 2, 32), (rows // 4, 16)]


class Model(nnx.Module):
    def __init__(self, rows: int):
        configs = [
            jr.EmbeddingBagConfig(
                name=f"t{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{i}"]
            )
            for i, (n, dim) in enumerate(_shapes(rows))
        ]
        self.ebc = jr.EmbeddingBagCollection(configs, rngs=nnx.Rngs(0))


def build(rows: int, gens: dict):
    model = Model(rows)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    plan = d.construct_module_sharding_plan(model.ebc, gens, world_size=8)
    model = d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh)
    return train.init_train_state(model, OPT)


def main(directory: str, megabytes: float) -> None:
    rows = int(megabytes * 2**20 / (4 * (64 + 64 + 16 + 4) + 4 * 3))
    saved_plan = {
        "t0": d.row_wise(),
        "t1": d.column_wise([0, 3, 5, 6]),
        "t2": d.table_wise(2),
        "t3": d.table_wise(7),
    }
    graphdef, state = build(rows, saved_plan)
    state = jax.tree.map(lambda x: x + 1, state)  # momentum nonzero
    size = sum(x.nbytes for x in jax.tree.leaves((state.tables, state.opt_state.sparse)))
    logical = sum(n * (dim + 1) * 4 for n, dim in _shapes(rows))
    out = {"state_bytes": size, "logical_bytes": logical, "staging_bytes": STAGING}

    base = _reset_peak()
    with ckpt.CheckpointManager(f"{directory}/sync", async_save=False, staging_bytes=STAGING) as m:
        m.save(1, graphdef, OPT, state)
    out["save"] = _kb("VmHWM") - base

    base = _reset_peak()
    with ckpt.CheckpointManager(f"{directory}/async", staging_bytes=STAGING) as m:
        m.save(1, graphdef, OPT, state)
    out["async_save"] = _kb("VmHWM") - base

    graphdef2, target = build(rows, {t: d.row_wise() for t in ("t0", "t1", "t2", "t3")})
    base = _reset_peak()
    with ckpt.CheckpointManager(f"{directory}/sync", staging_bytes=STAGING) as m:
        restored = m.restore(graphdef2, OPT, target)
    out["restore"] = _kb("VmHWM") - base
    out["restored_bytes"] = sum(
        x.nbytes for x in jax.tree.leaves((restored.tables, restored.opt_state.sparse))
    )
    del target
    got = train.merge_model(graphdef2, restored).ebc.state_dict()
    want = train.merge_model(graphdef, state).ebc.state_dict()
    out["equal"] = sorted(got) == sorted(want) and all(
        np.array_equal(np.asarray(got[k]), np.asarray(want[k])) for k in want
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
