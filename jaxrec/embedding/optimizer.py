"""CombinedOptimizer: an optax transformation for dense params plus fused sparse
optimizers for embedding tables (TorchRec's ``CombinedOptimizer`` and
``fused_params`` roles)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.core  # jax.core.Tracer: a submodule the type checker sees only when imported
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ..optim.base import SparseOptimizer, SparseOptState
from .collection import embedding_collections


@dataclasses.dataclass(frozen=True)
class SubGroup:
    """Tables of one stacked group that share one sparse optimizer.

    Their optimizer state is one buffer over the member tables' rows in group
    order; ``state_offsets[i]`` is where table ``i`` of the group starts in it.
    """

    optimizer: SparseOptimizer
    member: tuple[bool, ...]  # per table of the group
    state_offsets: tuple[int, ...]  # per table of the group
    num_rows: int

    @property
    def covers_group(self) -> bool:
        return all(self.member)


class CombinedOptState(NamedTuple):
    dense: optax.OptState
    sparse: dict[str, SparseOptState]  # "<module path>/<group>[#k]" -> its state


class CombinedOptimizer:
    """Dense optax transformation + per-table fused sparse optimizers.

    Args:
        dense: optax transformation for every ``nnx.Param`` of the model.
        sparse: the sparse optimizer for embedding tables (TorchRec's
            ``fused_params``).
        per_table: overrides by table name (TorchRec's
            ``apply_optimizer_in_backward`` per parameter).

    Example:
        >>> opt = CombinedOptimizer(optax.adam(1e-3), rowwise_adagrad(0.01),
        ...                         per_table={"user_table": sgd(0.1)})
    """

    def __init__(
        self,
        dense: optax.GradientTransformation,
        sparse: SparseOptimizer,
        per_table: Mapping[str, SparseOptimizer] | None = None,
    ):
        if not isinstance(sparse, SparseOptimizer):
            raise TypeError(
                f"sparse must be a jaxrec.optim SparseOptimizer, got {type(sparse).__name__}"
            )
        self.dense = dense
        self.sparse = sparse
        self.per_table = dict(per_table or {})

    def for_table(self, name: str) -> SparseOptimizer:
        return self.per_table.get(name, self.sparse)

    # group: a TableGroup, Any because tables.py imports this module (no import back)
    def subgroups(self, group: Any) -> list[SubGroup]:
        """Splits a stacked ``TableGroup`` by optimizer (one subgroup in the common case)."""
        opts: list[SparseOptimizer] = []
        for t in group.tables:
            o = self.for_table(t)
            if not any(o is x for x in opts):
                opts.append(o)
        rows = group.table_rows
        out = []
        for o in opts:
            member = tuple(self.for_table(t) is o for t in group.tables)
            offsets = np.cumsum([0] + [n if m else 0 for n, m in zip(rows, member, strict=True)])
            out.append(SubGroup(o, member, tuple(offsets[:-1].tolist()), int(offsets[-1])))
        return out

    def init(self, model: nnx.Module) -> CombinedOptState:
        """Dense optax state over the model's ``nnx.Param`` s and every embedding
        collection's zeroed sparse states (``init_optimizer_state``)."""
        self._check_overrides(model)
        sparse = {}
        for path, module in embedding_collections(model):
            sparse.update(module.init_optimizer_state(self, path))
        dense = self.dense.init(nnx.state(model, nnx.Param))
        meshes = {m.mesh for _, m in embedding_collections(model) if m.mesh is not None}
        if len(meshes) == 1:  # a sharded model: scalars (step counts) replicated, as after a step
            replicated = NamedSharding(meshes.pop(), PartitionSpec())
            dense = jax.tree.map(
                lambda x: (
                    jax.device_put(x, replicated)
                    if isinstance(x, jax.core.Tracer)  # built under eval_shape / jit
                    or isinstance(x.sharding, jax.sharding.SingleDeviceSharding)
                    else x
                ),
                dense,
            )
        return CombinedOptState(dense, sparse)

    def _check_overrides(self, model: nnx.Module) -> None:
        names = {t.name for _, m in embedding_collections(model) for t in m.table_configs}
        unknown = sorted(set(self.per_table) - names)
        if unknown:
            raise ValueError(
                f"per_table names {unknown} match no table; tables are {sorted(names)}"
            )

    def param_groups(self, model: nnx.Module, state: CombinedOptState | None = None) -> list[dict]:
        """One dict per parameter group (as TorchRec lists them): name, optimizer, lr, params.

        The dense learning rate is shown when the dense transformation was
        built with ``optax.inject_hyperparams`` and ``state`` is given.
        """
        dense_params = [
            ".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))
        ]
        lr = None
        injected = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
        if state is not None and isinstance(state.dense, injected):
            lr = float(np.asarray(state.dense.hyperparams["learning_rate"]))
        groups = [{"name": "dense", "optimizer": "optax", "lr": lr, "params": dense_params}]
        for path, module in embedding_collections(model):
            prefix = ".".join(map(str, path))
            for t in module.table_configs:
                o = self.for_table(t.name)
                groups.append(
                    {
                        "name": f"{prefix + '.' if prefix else ''}{module.prefix}.{t.name}.weight",
                        "optimizer": o.name,
                        "lr": o.learning_rate,
                        **o.hyperparams,
                        "params": [t.name],
                    }
                )
        return groups

    def describe(self, model: nnx.Module, state: CombinedOptState | None = None) -> str:
        """A printable table of the parameter groups."""
        lines = []
        for g in self.param_groups(model, state):
            extra = {k: v for k, v in g.items() if k not in ("name", "optimizer", "lr", "params")}
            n = f"{len(g['params'])} params" if g["name"] == "dense" else ""
            lines.append(f"{g['name']:<50} {g['optimizer']:<22} lr={g['lr']} {n}{extra or ''}")
        return "\n".join(lines)


def state_key(path: tuple, group: str, k: int) -> str:
    return "/".join([*map(str, path), group]) + (f"#{k}" if k else "")
