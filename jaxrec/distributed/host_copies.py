"""Host copies of table buffers for building, reading and checkpointing sharded collections.

Eager ``jnp`` slicing and casting compile a program per shape, so a model of hundreds
of tables compiled hundreds of programs while being sharded: these work on numpy
copies instead (``jnp`` ops only where the values are traced).
"""

from __future__ import annotations

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from ..embedding.tables import TableStorage


def logical_tables(module) -> dict:
    """``module.state_dict()``, sliced from host copies of its group buffers when they
    are concrete (no program compiled per table)."""
    if not isinstance(module, TableStorage):
        return module.state_dict()
    buffers = {g.name: module.weights[g.name].get_value() for g in module.groups}
    if any(isinstance(x, jax.core.Tracer) for x in buffers.values()):
        return module.state_dict()
    out = {}
    for g in module.groups:
        host = np.asarray(buffers[g.name])
        for name, lo, n in zip(g.tables, g.row_offsets, g.table_rows, strict=True):
            out[f"{module.prefix}.{name}.weight"] = host[lo : lo + n]
    return out


def cast(x, dtype):
    """``x`` in ``dtype``: numpy on the host (``jnp.asarray`` of a host array compiles a
    program per shape: hundreds of tables compiled hundreds), jnp when traced."""
    if isinstance(x, jax.core.Tracer):
        return jnp.asarray(x, dtype)
    return np.asarray(x).astype(jnp.dtype(dtype))


def host_float32(x: jax.Array) -> np.ndarray:
    """A float32 host copy, gathered from every process when not fully addressable."""
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jnp.asarray(x).astype(jnp.float32))
