"""Reading format 1 checkpoints (orbax, whole tables), written by jaxrec before format 2.

They are read, not converted: tables come whole into host memory, as they were
written (such checkpoints were only ever as large as host memory). Saving always
writes format 2; a run that resumes from a format 1 step writes format 2 next.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from .logical import LogicalState, place_state
from .paths import dense_leaves, nest
from .spec import DENSE_PARTS
from .store import CheckpointCorruptError

FORMAT = "jaxrec.checkpoint/1"


def is_legacy(step_dir: str) -> bool:
    return os.path.isfile(os.path.join(step_dir, "meta", "metadata"))


def read_meta(step_dir: str) -> dict:
    path = os.path.join(step_dir, "meta", "metadata")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{path}: {e}") from None


def restore(step_dir: str, meta: dict, graphdef, optimizer, target, what: str):
    """The format 1 checkpoint at ``step_dir`` in ``target``'s plan (spec already checked)."""
    item, args = _restore_item(meta["spec"], target)
    try:
        out = ocp.PyTreeCheckpointer().restore(
            os.path.join(step_dir, "state"), item=item, restore_args=args
        )
    except Exception as e:  # noqa: BLE001  (orbax and TensorStore raise many types)
        raise CheckpointCorruptError(f"{what}: {e}") from None
    saved = {k: out.get(k, {}) for k in (*DENSE_PARTS, "tables")}
    return place_state(graphdef, optimizer, target, LogicalState(**saved))


def _restore_item(spec, target) -> tuple[dict, dict]:
    """Abstract tree and restore args: dense leaves into the target's shardings,
    tables as host numpy arrays."""
    item: dict = {}
    args: dict = {}
    parts = dict(
        zip(DENSE_PARTS, (target.params, target.rest, target.opt_state.dense), strict=True)
    )
    for name, tree in parts.items():
        leaves = dense_leaves(tree)
        if not leaves:
            continue
        item[name] = nest(
            [(c, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)) for c, x in leaves]
        )
        args[name] = nest([(c, ocp.ArrayRestoreArgs(sharding=x.sharding)) for c, x in leaves])
    if spec["tables"]:
        item["tables"], args["tables"] = {}, {}
    for key, t in spec["tables"].items():
        arrays = {"weight": t, **t["state"], "count": None}
        item["tables"][key] = {
            f: np.zeros((), np.int32) if a is None else _abstract(a) for f, a in arrays.items()
        }
        args["tables"][key] = {f: ocp.RestoreArgs(restore_type=np.ndarray) for f in arrays}
    return item, args


def _abstract(a) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(a["shape"]), jnp.dtype(a["dtype"]))
