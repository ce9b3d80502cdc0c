"""Table specs for the dry run: JSON or CSV files of tables with their constraints.

JSON: a list of tables, or ``{"tables": [...], "topology": {...}, "optimizer":
"adam", "capacity": 4096}``. CSV: one table per row with a header. A table
has ``EmbeddingBagConfig`` fields (``name``, ``num_embeddings``,
``embedding_dim``, optional ``data_type``, ``feature_names``, ``pooling``)
and optional ``ParameterConstraints`` fields (``sharding_types``,
``compute_kernels``, ``pooling_factors`` or ``pooling_factor``,
``num_poolings``, ``batch_sizes``, ``feature_capacities``, ``min_partition``,
``ranks``, ``is_weighted``, ``hbm_only``; ``cache_load_factor`` and
``cache_algorithm`` give its ``cache_params``). In CSV, list values are
separated by ``;``.
"""

from __future__ import annotations

import csv
import json
import pathlib
from collections.abc import Mapping
from typing import Any

from ...configs import DataType, EmbeddingBagConfig, PoolingType
from ..types import CacheParams
from .constraints import ParameterConstraints

_CONFIG = {"name", "num_embeddings", "embedding_dim", "data_type", "feature_names", "pooling"}
_LISTS = {
    "sharding_types",
    "compute_kernels",
    "pooling_factors",
    "num_poolings",
    "batch_sizes",
    "feature_capacities",
    "ranks",
    "feature_names",
}
_SCALARS = {"min_partition", "is_weighted", "hbm_only", "cache_load_factor", "cache_algorithm"}
_NUMBERS = {
    "pooling_factors": float,
    "num_poolings": float,
    "batch_sizes": int,
    "feature_capacities": int,
    "ranks": int,
}


def _table(raw: Mapping[str, Any], where: str) -> tuple[EmbeddingBagConfig, ParameterConstraints]:
    d = {k: v for k, v in raw.items() if v not in (None, "")}
    if "pooling_factor" in d:
        d["pooling_factors"] = d.pop("pooling_factor")
    unknown = sorted(set(d) - _CONFIG - _LISTS - _SCALARS)
    if unknown:
        raise ValueError(f"{where}: unknown table fields {unknown}")
    for k in _LISTS & set(d):
        v = d[k]
        if isinstance(v, str):
            v = [x for x in v.replace(",", ";").split(";") if x.strip()]
        elif not isinstance(v, list | tuple):
            v = [v]
        d[k] = [_NUMBERS[k](x) if k in _NUMBERS else str(x).strip() for x in v]
    try:
        cfg = EmbeddingBagConfig(
            name=str(d["name"]),
            num_embeddings=int(d["num_embeddings"]),
            embedding_dim=int(d["embedding_dim"]),
            data_type=DataType(str(d.get("data_type", "FP32")).upper()),
            feature_names=tuple(d.get("feature_names", ())),
            pooling=PoolingType(str(d.get("pooling", "SUM")).upper()),
        )
    except KeyError as e:
        raise ValueError(f"{where}: a table needs {e.args[0]!r}") from None
    cons = {k: v for k, v in d.items() if k not in _CONFIG}
    if "min_partition" in cons:
        cons["min_partition"] = int(cons["min_partition"])
    for flag in ("is_weighted", "hbm_only"):
        if flag in cons:
            w = cons[flag]
            cons[flag] = (
                str(w).strip().lower() in ("1", "true", "yes") if isinstance(w, str) else bool(w)
            )
    cache = {}
    if "cache_load_factor" in cons:
        cache["load_factor"] = float(cons.pop("cache_load_factor"))
    if "cache_algorithm" in cons:
        cache["algorithm"] = str(cons.pop("cache_algorithm")).strip().lower()
    if cache:
        cons["cache_params"] = CacheParams(**cache)
    return cfg, ParameterConstraints(**cons)


def load_table_specs(path: str | pathlib.Path) -> tuple[list, dict, dict]:
    """``(tables, constraints, settings)`` from a JSON or CSV file.

    ``settings`` holds the JSON file's ``topology`` (Topology fields),
    ``optimizer`` and ``capacity`` if present.
    """
    path = pathlib.Path(path)
    text = path.read_text()
    settings: dict = {}
    if path.suffix.lower() == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
    else:
        raw = json.loads(text)
        if isinstance(raw, Mapping):
            settings = {k: raw[k] for k in ("topology", "optimizer", "capacity") if k in raw}
            unknown = sorted(set(raw) - {"tables", "topology", "optimizer", "capacity"})
            if unknown:
                raise ValueError(f"{path}: unknown top-level keys {unknown}")
            rows = raw.get("tables", [])
        else:
            rows = raw
    if not rows:
        raise ValueError(f"{path}: no tables")
    tables, constraints = [], {}
    for i, row in enumerate(rows):
        cfg, cons = _table(row, f"{path} table {i}")
        tables.append(cfg)
        if cons != ParameterConstraints():
            constraints[cfg.name] = cons
    return tables, constraints, settings
