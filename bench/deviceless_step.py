"""Train steps compiled deviceless for GPUs: abstract state, batches and XLA's memory figures.

Shared by ``bench/sharded.py --gpu`` and ``tests/gpu_compile/step_cases.py``.
Nothing here allocates a table: the model and its :class:`~jaxrec.train.TrainState`
are built under ``jax.eval_shape`` on a mesh over a compile-only CUDA topology
(``jaxrec.deviceless``), so an 8 x 80 GB model compiles on a laptop. Needs the
CUDA plugin, ``ptxas`` and ``JAX_PLATFORMS=cpu`` (see ``jaxrec.deviceless``).

Per-device memory is compared three ways: the planner's estimate
(``EmbeddingShardingPlanner.estimate``: tables, optimizer state, lookup
buffers), the bytes of the abstract state's shards, and the compiled
program's ``memory_analysis()`` (arguments, temporaries, outputs, aliasing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.extend
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrec import train
from jaxrec.deviceless import COMPILER_OPTIONS  # no CUB sort without a device: see there

TARGET = "deviceless compile for H100 (sm_90a), no GPU run"


def gpu_mesh(topology: str) -> jax.sharding.Mesh:
    """A mesh over a compile-only H100 topology: axis ``"x"`` on one host, else
    ``("host", "local")`` (the plan builders' host = the last axis)."""
    from jaxrec import deviceless

    topo = deviceless.topology(topology)
    _, hosts, local = (int(x) for x in topology.split("x"))
    if hosts == 1:
        return deviceless.mesh(topo, ("x",))
    return deviceless.mesh(topo, ("host", "local"), (hosts, local))


def placed(fn: Callable[[], Any], mesh: jax.sharding.Mesh) -> Any:
    """``fn()``'s outputs as ``ShapeDtypeStruct`` s with the shardings ``fn`` puts them on.

    ``fn`` is traced, not run: each output produced by a ``jax.device_put`` to a
    ``NamedSharding`` gets that sharding (what ``DistributedModelParallel`` and
    the sharded collections' optimizer init do), every other output is
    replicated over ``mesh``.
    """
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)()
    put: dict = {}
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            put.update(zip(eqn.outvars, eqn.params["devices"], strict=True))
    flat, tree = jax.tree.flatten(shapes)
    out = []
    for var, s in zip(closed.jaxpr.outvars, flat, strict=True):
        sharding = None if isinstance(var, jax.extend.core.Literal) else put.get(var)
        if not isinstance(sharding, NamedSharding):
            sharding = NamedSharding(mesh, P())
        out.append(jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding))
    return jax.tree.unflatten(tree, out)


def abstract_batch(local: Any, mesh: jax.sharding.Mesh) -> Any:
    """What ``shard_batch`` makes of one device's batch, repeated on every device, abstractly.

    KeyedJaggedTensor leaves become ``[world, ...]``, arrays ``[world * B, ...]``,
    both sharded over every mesh axis.
    """
    from jaxrec import KeyedJaggedTensor

    spec = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    n = mesh.size

    def one(x):
        if isinstance(x, KeyedJaggedTensor):
            return jax.tree.map(
                lambda v: jax.ShapeDtypeStruct((n, *v.shape), v.dtype, sharding=spec), x
            )
        return jax.ShapeDtypeStruct((n * x.shape[0], *x.shape[1:]), x.dtype, sharding=spec)

    return jax.tree.map(one, local, is_leaf=lambda x: isinstance(x, KeyedJaggedTensor))


def compile_train_step(
    build: Callable[[], Any],
    optimizer: Any,
    loss_fn: Callable,
    local_batch: Any,
    mesh: jax.sharding.Mesh,
    *,
    implementation: str | None = None,
    sharded: bool = True,
) -> tuple[Any, train.TrainState]:
    """``(compiled step, abstract state)`` of ``make_train_step`` for the model ``build()`` makes.

    ``build`` returns the (sharded, or replicated on ``mesh``) model; it runs
    under tracing only. ``local_batch`` is one device's batch (arrays or shape
    structs); ``sharded=False`` passes it as the global batch, replicated (one device).
    """
    from flax import nnx

    graphdef = nnx.graphdef(nnx.eval_shape(build))
    state = placed(lambda: train.init_train_state(build(), optimizer)[1], mesh)
    step = train.make_train_step(graphdef, optimizer, loss_fn, implementation=implementation)
    if sharded:
        batch = abstract_batch(local_batch, mesh)
    else:
        spec = NamedSharding(mesh, P())
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec), local_batch
        )
    compiled = step.jitted.trace(state, batch).lower().compile(compiler_options=COMPILER_OPTIONS)
    return compiled, state


def device_bytes(tree: Any) -> int:
    """Bytes of one device's shards of the abstract arrays in ``tree`` (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def memory_report(compiled: Any, state: train.TrainState, estimate: Any = None) -> dict:
    """Per-device bytes: the compiler's, the abstract state's and (optionally) the planner's.

    ``embedding_args``: the tables and sparse optimizer state among the
    arguments (the state's shards); ``compiler_embedding``: the compiler's
    arguments less everything else it was given (dense params and state, the
    batch). ``estimate`` is a ``PlanStats``; its ``(tables, state, buffers)``
    are compared with ``compiler_embedding`` and the temporaries.
    """
    m = compiled.memory_analysis()
    emb = device_bytes(state.tables) + device_bytes(state.opt_state.sparse)
    other = device_bytes((state.params, state.rest, state.opt_state.dense))
    args = int(m.argument_size_in_bytes)
    out = {
        "argument": args,
        "output": int(m.output_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "peak": args
        + int(m.temp_size_in_bytes)
        + int(m.output_size_in_bytes)
        - int(m.alias_size_in_bytes),
        "embedding_args": emb,
        "dense_state_args": other,
        "batch_args": args - emb - other,
    }
    if estimate is not None:
        w, s, buf = (float(x) for x in estimate.placement.memory)
        out.update(
            estimate_tables=w,
            estimate_state=s,
            estimate_buffers=buf,
            ratio_tables_state=round((w + s) / emb, 4),
            ratio_buffers_temp=round(buf / max(1, out["temp"]), 4),
            ratio_total=round((w + s + buf) / (emb + out["temp"]), 4),
        )
    return out


def planner_estimate(
    plan: Any,
    tables: Mapping[str, list],
    *,
    world_size: int,
    local_world_size: int,
    batch_size: int,
    capacities: Mapping[str, list[int]],
    optimizer: Any,
    hbm_cap: int = 80 * 1024**3,
) -> Any:
    """The planner's ``PlanStats`` for ``plan`` on H100s (80 GiB), batch and id capacities
    as the compiled step sees them (``capacities``: per table, ids per feature per device)."""
    from jaxrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    topo = Topology(
        world_size=world_size,
        local_world_size=local_world_size,
        hbm_cap=hbm_cap,
        batch_size=batch_size,
    )
    cons = {t: ParameterConstraints(feature_capacities=list(c)) for t, c in capacities.items()}
    return EmbeddingShardingPlanner(topo, optimizer=optimizer).estimate(plan, tables, topo, cons)
