"""A model built from its constructor without drawing its tables: TorchRec's ``meta`` device.

``nnx.eval_shape(make)`` gives the model's structure and shapes and allocates
nothing; the planner plans on it. Its values then come from running ``make``
once more under ``jit``, returning everything but the tables (replicated on the
mesh) and each collection's init key: XLA drops the table draws, whose results
nothing reads, so no table is ever materialised. The sharded collections draw
their shards from those keys on their own devices (``shard_init.py``), with the
values the eager build gives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..embedding.tables import EmbeddingTable, TableStorage, recording_init_keys


class AbstractModel(NamedTuple):
    """``model``: tables abstract (``jax.ShapeDtypeStruct``), every other variable
    concrete and replicated over the mesh; ``init_keys``: each collection's init key
    (a JAX key) by module path (``"a.b"``)."""

    model: nnx.Module
    init_keys: dict[str, jax.Array]


def is_abstract(model: nnx.Module) -> bool:
    """Whether any variable of ``model`` holds a shape only (``nnx.eval_shape``)."""
    return any(
        isinstance(v.get_value(), jax.ShapeDtypeStruct)
        for _, v in nnx.to_flat_state(nnx.state(model))
    )


def build_abstract(make: Callable[[], nnx.Module], mesh: jax.sharding.Mesh) -> AbstractModel:
    """``make()``'s model with abstract tables and concrete, replicated other values.

    The values are those ``make()`` gives eagerly: dense layers are drawn by the same
    code under ``jit``, and each collection's tables will be drawn from its recorded key.
    """
    with recording_init_keys(draw=False):
        model = nnx.eval_shape(make)
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"the model constructor must return an nnx.Module, got {type(model).__name__}"
        )

    def values():
        built, keys = _built_with_keys(make)
        return nnx.state(built, nnx.Not(EmbeddingTable)), keys

    state, keys = jax.jit(values, out_shardings=NamedSharding(mesh, P()))()
    nnx.update(model, state)
    return AbstractModel(model, keys)


def init_keys(make: Callable[[], nnx.Module]) -> dict[str, jax.Array]:
    """Each embedding collection's init key by module path (``"a.b"``), from running
    ``make`` under ``jit`` with nothing else kept (nothing is drawn). With a table's
    index in its collection (its stream), the key draws the table's rows anywhere:
    e.g. a cached table's host rows (``jaxrec.cache.HostTable.create``)."""

    return jax.jit(lambda: _built_with_keys(make)[1])()


def _built_with_keys(make: Callable[[], nnx.Module]) -> tuple[nnx.Module, dict[str, jax.Array]]:
    """``make()`` (tables not drawn: call under tracing) and its collections' init keys
    by module path."""
    with recording_init_keys(draw=False) as recorded:
        built = make()
    keys = {
        _name(path): recorded[id(m)]
        for path, m in nnx.iter_modules(built)
        if isinstance(m, TableStorage) and id(m) in recorded
    }
    return built, keys


def draw_unsharded(model: nnx.Module, keys: dict[str, jax.Array], mesh) -> None:
    """Draws, replicated, the tables of collections left unsharded (the plan did not
    name them) and still abstract: whole on every device, as an unsharded module is."""
    replicated = NamedSharding(mesh, P())
    for path, m in nnx.iter_modules(model):
        if not isinstance(m, TableStorage) or _name(path) not in keys:
            continue
        for g in m.groups:
            var = m.weights[g.name]
            if isinstance(var.get_value(), jax.ShapeDtypeStruct):
                draw = jax.jit(lambda k, g=g, m=m: m.initial_weights(g, k))
                var.set_value(jax.device_put(draw(keys[_name(path)]), replicated))


def _name(path: tuple) -> str:
    return ".".join(map(str, path))
