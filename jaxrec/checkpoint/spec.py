"""What a checkpoint holds, as JSON: table shapes, optimizer state fields, dense leaves.

Written beside every checkpoint and compared with the target before any array
is read, so that restoring into a mismatched model fails with a list of
differences instead of a shape error deep inside orbax.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from ..embedding.collection import embedding_collections
from ..embedding.optimizer import CombinedOptimizer
from ..optim.base import row_fields
from ..train.step import TrainState, merge_model
from .layout import host_rows
from .paths import dense_leaves, flatten, table_key

DENSE_PARTS = ("params", "rest", "dense_opt")


def check_caches(graphdef: nnx.GraphDef, state: TrainState, host: Mapping | None) -> None:
    """Refuses a device cache (``cached_rows``: ``jaxrec.cache``) without its host table:
    its slots are not its table's rows, so a checkpoint of them would be no table."""
    model = merge_model(graphdef, state)
    host = host or {}
    missing = [
        t.name
        for path, module in embedding_collections(model)
        for t in module.table_configs
        if t.cached_rows is not None and table_key(path, module, t.name) not in host
    ]
    if missing:
        raise ValueError(
            f"tables {missing} are device caches of host tables (jaxrec.cache): their slots "
            "are not the tables' rows; save with RowCache.save and restore with "
            "RowCache.restore / resume, which write and read the logical tables"
        )


def state_spec(
    graphdef: nnx.GraphDef,
    optimizer: CombinedOptimizer,
    state: TrainState,
    host: Mapping[str, Mapping[str, np.ndarray]] | None = None,
) -> dict:
    """The logical content of ``state`` (shapes and dtypes only; nothing is gathered);
    ``host``: tables kept in host memory, by key (their rows are the host arrays').

    Returns:
        The same dict under every sharding plan, of the form::

            {"tables": {key: {"shape", "dtype", "optimizer",
                              "state": {field: {"shape", "dtype"}}}},
             "params" | "rest" | "dense_opt": {"a/b/c": {"shape", "dtype"}}}
    """
    model = merge_model(graphdef, state)
    tables = {}
    for path, module in embedding_collections(model):
        for t in module.table_configs:
            opt = optimizer.for_table(t.name)
            init = functools.partial(opt.init, t.num_embeddings, t.embedding_dim)
            st = jax.eval_shape(init)
            key = table_key(path, module, t.name)
            fields = {f: _array(getattr(st, f)) for f in row_fields(st)}
            rows = t.num_embeddings
            if host and key in host:  # the device table is a cache: the host has the rows
                part = host_rows(host[key])  # (this process's part of them)
                rows = part.total
                fields = {
                    f: {"shape": [rows, *a.shape[1:]], "dtype": np.dtype(a.dtype).name}
                    for f, a in part.items()
                    if f != "weight"
                }
            tables[key] = {
                "shape": [rows, t.embedding_dim],
                "dtype": np.dtype(t.dtype).name,
                "optimizer": opt.name,
                "state": fields,
            }
    parts = (state.params, state.rest, state.opt_state.dense)
    out: dict[str, Any] = {"tables": tables}
    for name, tree in zip(DENSE_PARTS, parts, strict=True):
        out[name] = {"/".join(c): _array(x) for c, x in dense_leaves(tree)}
    return out


def logical_spec(logical: Any) -> dict:
    """:func:`state_spec` of a :class:`LogicalState` (no optimizer names)."""
    tables = {}
    for key, entry in logical.tables.items():
        w = entry["weight"]
        tables[key] = {
            "shape": list(w.shape),
            "dtype": np.dtype(w.dtype).name,
            "optimizer": None,
            "state": {f: _array(x) for f, x in entry.items() if f not in ("weight", "count")},
        }
    out: dict[str, Any] = {"tables": tables}
    for name in DENSE_PARTS:
        out[name] = {"/".join(c): _array(x) for c, x in flatten(getattr(logical, name))}
    return out


def check_compatible(saved: Mapping, expected: Mapping, what: str) -> None:
    """Raises ``ValueError`` listing every difference between two specs."""
    problems = []
    have, want = saved["tables"], expected["tables"]
    if missing := sorted(set(want) - set(have)):
        problems.append(f"tables missing from {what}: {missing}")
    if extra := sorted(set(have) - set(want)):
        problems.append(f"tables in {what} that the target does not have: {extra}")
    for key in sorted(set(have) & set(want)):
        h, w = have[key], want[key]
        if (h["shape"], h["dtype"]) != (w["shape"], w["dtype"]):
            problems.append(
                f"table {key}: {h['dtype']}{h['shape']} in {what}, the target has "
                f"{w['dtype']}{w['shape']}"
            )
        if None not in (h["optimizer"], w["optimizer"]) and h["optimizer"] != w["optimizer"]:
            problems.append(
                f"table {key}: optimizer {h['optimizer']} in {what}, the target uses "
                f"{w['optimizer']}"
            )
        if h["state"] != w["state"]:
            problems.append(
                f"table {key}: optimizer state fields {_fields(h['state'])} in {what}, the "
                f"target's optimizer has {_fields(w['state'])}"
            )
    for part in DENSE_PARTS:
        h, w = saved[part], expected[part]
        if missing := sorted(set(w) - set(h)):
            problems.append(f"{part} leaves missing from {what}: {_few(missing)}")
        if extra := sorted(set(h) - set(w)):
            problems.append(f"{part} leaves in {what} that the target does not have: {_few(extra)}")
        for k in sorted(set(h) & set(w)):
            if h[k] != w[k]:
                problems.append(f"{part} leaf {k}: {_fmt(h[k])} in {what}, target {_fmt(w[k])}")
    if problems:
        raise ValueError(
            f"{what} does not match the target state:\n  - "
            + "\n  - ".join(problems)
            + "\nBuild the target from the same model (table configs, dense layers) and "
            "optimizer as the saved run; its sharding plan and device count may differ."
        )


def _array(x) -> dict:
    return {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name}


def _fmt(a: Mapping) -> str:
    return f"{a['dtype']}{a['shape']}"


def _fields(state: Mapping) -> str:
    return "{" + ", ".join(f"{f}: {_fmt(a)}" for f, a in sorted(state.items())) + "}"


def _few(keys: list, n: int = 6) -> str:
    return str(keys[:n])[:-1] + (f", ... ({len(keys)} in all)]" if len(keys) > n else "]")
