"""The pipelined (sparse-dist) train step compiled deviceless for 8 H100s, and where XLA
schedules the next batch's id ``all_to_all`` in it.

A small model (a row-wise and a table-wise table of 1M x 64, a dense layer and
a linear head; 256 samples x 4 ids per device, every default: Pallas kernels,
WARNING bounds checks, exact overflow) keeps the compile short; the program's
shape is the DLRM's. ``facts["ahead"]`` describes the entry computation's
schedule (``is_scheduled=true``: instructions in execution order) around the
``all-to-all`` that sends the next batch's ids (ops named under
``jaxrec.train.sparse_dist_step.AHEAD_SCOPE``).
"""

from __future__ import annotations

import re

import deviceless_step as ds
import jax
import jax.numpy as jnp
from compile_runner import Case
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from step_cases import STEP_TIMEOUT_S, _local_batch, _loss, _optimizer, _tables

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import train
from jaxrec.deviceless import COMPILER_OPTIONS
from jaxrec.train.sparse_dist_step import AHEAD_SCOPE

COMPUTE = ("fusion", "custom-call", "while", "conditional", "sort", "call")
_OP = re.compile(r"^\s*(?:ROOT )?(%\S+) = (.*?)\s([a-z][\w\-]*)\((.*)$")


class _Model(nnx.Module):
    def __init__(self, tables):
        self.ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
        self.bottom = nnx.Linear(13, 128, rngs=nnx.Rngs(1))
        self.head = nnx.Linear(256, 1, rngs=nnx.Rngs(2))

    def __call__(self, dense, kjt):
        x = jnp.concatenate([jax.nn.relu(self.bottom(dense)), self.ebc(kjt).values()], axis=1)
        return self.head(x)


def entry_schedule(text: str) -> list[tuple[str, str, str, str]]:
    """``(name, shape, opcode, operands and attributes)`` of each entry instruction, in order."""
    body = text[text.index("\nENTRY ") :].split("\n}\n")[0].splitlines()[1:]
    return [m.groups() for m in map(_OP.match, body) if m]


def ahead_window(text: str) -> dict:
    """Where the next batch's ids ``all-to-all`` starts and ends, and what runs between."""
    ops = entry_schedule(text)
    starts = [
        i
        for i, (_, _, op, rest) in enumerate(ops)
        if op == "all-to-all-start" and AHEAD_SCOPE in rest
    ]
    if len(starts) != 1:
        return {"starts": len(starts)}
    start = starts[0]
    name = ops[start][0]
    done = next(
        i
        for i, (_, _, op, rest) in enumerate(ops)
        if op == "all-to-all-done" and rest.startswith(name + ")")
    )
    between: dict[str, int] = {}
    for _, _, op, _ in ops[start + 1 : done]:
        if op in COMPUTE:
            between[op] = between.get(op, 0) + 1
    int32 = [n for n, shape, op, _ in ops if op == "all-to-all-start" and "s32[" in shape]
    return {
        "starts": 1,
        "start": start,
        "done": done,
        "entry_ops": len(ops),
        "compute_between": between,
        "int32_all_to_all_starts": len(int32),
        "is_scheduled": "is_scheduled=true" in text.split("\n", 1)[0],
    }


def sparse_dist_step(*, batch=256, ids_per_bag=4):
    """make_sparse_dist_train_step's program on 1x1x8 H100s (deviceless)."""
    tables = _tables([1_000_000, 1_000_000], 64, names=["row_wise", "table_wise"])
    gens = {"row_wise": d.row_wise(), "table_wise": d.table_wise(3)}
    mesh = ds.gpu_mesh("1x1x8")
    ebc = nnx.eval_shape(lambda: jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0)))
    module = d.construct_module_sharding_plan(ebc, gens, world_size=8, local_size=8)
    plan = d.ShardingPlan({"ebc": module})
    opt = _optimizer()

    def build():
        return d.DistributedModelParallel(_Model(tables), plan, mesh)

    graphdef = nnx.graphdef(nnx.eval_shape(build))
    state = ds.placed(lambda: train.init_train_state(build(), opt)[1], mesh)
    data = ds.abstract_batch(_local_batch(tables, batch, ids_per_bag), mesh)
    step = train.make_sparse_dist_train_step(graphdef, opt, _loss)
    spec = NamedSharding(mesh, P(tuple(mesh.axis_names)))  # ids: sharded like the batch
    ids = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=spec),
        jax.eval_shape(step.input_dist, state, data),
    )
    compiled = (
        step.jitted.trace(state, ids, data, data).lower().compile(compiler_options=COMPILER_OPTIONS)
    )
    return compiled, {"ahead": ahead_window(compiled.as_text())}


CASES = (
    Case(
        name="sparse_dist_step_1x1x8",
        target="pipeline_cases:sparse_dist_step",
        timeout_s=STEP_TIMEOUT_S,
    ),
)
