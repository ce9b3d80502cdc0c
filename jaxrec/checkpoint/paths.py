"""How a train state's pieces are named in a checkpoint (shared by the logical view and spec)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..embedding.collection import PlanLocal

# Per-device diagnostics whose shape depends on the mesh: not checkpointed; a
# restored state keeps the target's values.
PLAN_LOCAL = (PlanLocal,)


def table_key(path: tuple, module: Any, table: str) -> str:
    """TorchRec's fully qualified name of a table, without ``.weight``."""
    return ".".join([*map(str, path), module.prefix, table])


def dense_leaves(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
    """``(path components, leaf)`` of every array leaf, plan-local variables left out.

    Typed PRNG keys are given as their ``key_data`` (uint32).
    """
    out, seen = [], set()
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]:
        if isinstance(node, PLAN_LOCAL):
            continue
        for sub, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
            comps = components((*path, *sub))
            if comps in seen:
                raise ValueError(f"two leaves of the state have the same path {comps}")
            seen.add(comps)
            out.append((comps, jax.random.key_data(leaf) if is_key(leaf) else leaf))
    return out


def nest(items: list[tuple[tuple[str, ...], Any]]) -> dict:
    """Nested string-keyed dicts from ``(path components, leaf)`` pairs."""
    out: dict = {}
    for comps, leaf in items:
        node = out
        for c in comps[:-1]:
            node = node.setdefault(c, {})
        node[comps[-1]] = leaf
    return out


def flatten(nested: dict, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """The inverse of :func:`nest`."""
    out = []
    for k, v in nested.items():
        if isinstance(v, dict):
            out.extend(flatten(v, (*prefix, k)))
        else:
            out.append(((*prefix, k), v))
    return out


def components(path) -> tuple[str, ...]:
    """A JAX key path as strings (dict keys, attribute names, sequence indices)."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
