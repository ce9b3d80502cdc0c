"""CheckpointManager: orbax save/restore of train states in the logical layout.

A checkpoint step is a directory with two orbax items: ``state`` (the
:class:`LogicalState` arrays) and ``meta`` (JSON: format, step, the spec of
``spec.py`` and the caller's metadata). It restores under any sharding plan
and device count.

Multi-process runs: every process calls ``save`` and ``restore`` (tables are
gathered with collectives, orbax synchronises the processes). Gathered tables
are numpy arrays, identical on every process, that orbax writes from process 0
only; dense leaves are ``jax.Array`` s that orbax writes once per replica-0
shard; the JSON is written by the primary host.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from ..embedding.optimizer import CombinedOptimizer
from ..train.step import TrainState
from .logical import LogicalState, logical_state, place_state
from .paths import components, dense_leaves, is_variable, nest
from .spec import DENSE_PARTS, check_compatible, state_spec

FORMAT = "jaxrec.checkpoint/1"


class CheckpointManager:
    """Saves and restores train states under ``directory/<step>/``.

    No TorchRec class matches (TorchRec checkpoints its sharded ``state_dict``
    with ``torch.distributed.checkpoint``); the step directories and options
    are orbax's ``CheckpointManager``'s.

    Args:
        directory: where the step directories go (created if needed).
        max_to_keep: keep only the newest N steps (``None``: keep all).
        async_save: write in a background thread. ``save`` returns once the
            state is copied to host memory, so the next (donating) train step
            may run at once.
        save_interval_steps: ``save`` without ``force`` skips steps that are not
            a multiple of it, except the first save in an empty directory, and
            steps not after the latest saved one (orbax's policy).

    Example:
        >>> mgr = CheckpointManager("/tmp/run", max_to_keep=3)
        >>> graphdef, state = init_train_state(model, optimizer)
        >>> state, start = mgr.resume(graphdef, optimizer, state)  # (state, 0) on a fresh run
        >>> for step in range(start, num_steps):
        ...     state, loss, _ = train_step(state, batches[step])
        ...     mgr.save(step + 1, graphdef, optimizer, state)
        >>> mgr.close()
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        async_save: bool = True,
        save_interval_steps: int = 1,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, item_names=("state", "meta"), options=options
        )

    def save(
        self,
        step: int,
        graphdef: nnx.GraphDef,
        optimizer: CombinedOptimizer,
        state: TrainState,
        *,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves ``state`` (any plan) as step ``step``; returns whether it saved.

        Args:
            step: the step number (by convention, training steps completed).
            graphdef, optimizer, state: as given to ``make_train_step``.
            metadata: JSON-serialisable extras (data position, config, ...);
                read back with :meth:`metadata`.
            force: save even where ``save_interval_steps`` would skip the step.

        Tables and their optimizer state are first gathered into host memory
        (logical layout; the synchronous part of the call), then written.
        """
        step = int(step)
        if not force and not self._manager.should_save(step):
            return False
        user = dict(metadata or {})
        try:
            json.dumps(user)
        except TypeError as e:
            raise TypeError(f"metadata must be JSON-serialisable: {e}") from None
        logical = logical_state(graphdef, optimizer, state)
        meta = {
            "format": FORMAT,
            "step": step,
            "spec": state_spec(graphdef, optimizer, state),
            "metadata": user,
        }
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(_saved_tree(logical)), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )

    def restore(
        self,
        graphdef: nnx.GraphDef,
        optimizer: CombinedOptimizer,
        target: TrainState,
        *,
        step: int | None = None,
    ) -> TrainState:
        """The saved state in ``target``'s plan, layout and shardings.

        ``target`` only gives structure and shardings (build it with
        ``init_train_state`` on the model sharded as wanted); its values are not
        read. Dense leaves are read by orbax straight into the target's
        shardings. Tables are read whole into host memory on every process
        and converted to the target's layout there (see :func:`place_state`).

        Args:
            step: the step to restore (default: the latest).

        Raises:
            FileNotFoundError: no such step.
            ValueError: the checkpoint does not fit the target model/optimizer
                (every difference is listed).
        """
        step = self._step(step)
        meta = self._meta(step)
        expected = state_spec(graphdef, optimizer, target)
        check_compatible(meta["spec"], expected, f"checkpoint step {step} in {self.directory}")
        item, args = _restore_item(meta["spec"], target)
        out = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item, restore_args=args))
        )
        saved = {k: out["state"].get(k, {}) for k in (*DENSE_PARTS, "tables")}
        return place_state(graphdef, optimizer, target, LogicalState(**saved))

    def resume(
        self, graphdef: nnx.GraphDef, optimizer: CombinedOptimizer, state: TrainState
    ) -> tuple[TrainState, int]:
        """``(latest saved state in state's layout, its step)``, or ``(state, 0)`` if none."""
        step = self.latest_step()
        if step is None:
            return state, 0
        return self.restore(graphdef, optimizer, state, step=step), step

    def metadata(self, step: int | None = None) -> dict:
        """The ``metadata`` given to :meth:`save` for ``step`` (default: the latest)."""
        return self._meta(self._step(step))["metadata"]

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Blocks until pending async saves are written."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        elif int(step) not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; steps: {self.all_steps()}"
            )
        return int(step)

    def _meta(self, step: int) -> dict:
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = meta["meta"]
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(
                f"step {step} in {self.directory} is not a jaxrec checkpoint "
                f"(format {meta.get('format') if isinstance(meta, dict) else None!r})"
            )
        return meta


def _saved_tree(logical: LogicalState) -> dict:
    """The orbax tree; empty parts are left out (orbax keeps no empty dicts)."""
    return {k: v for k, v in logical._asdict().items() if v}


def _restore_item(spec: Mapping, target: TrainState) -> tuple[dict, dict]:
    """Abstract tree and restore args: dense leaves into the target's shardings,
    tables as host numpy arrays (converted to the target's layout afterwards)."""
    item: dict = {}
    args: dict = {}
    parts = dict(
        zip(DENSE_PARTS, (target.params, target.rest, target.opt_state.dense), strict=True)
    )
    for name, tree in parts.items():
        shardings = _shardings(tree)
        leaves = dense_leaves(tree)
        if not leaves:
            continue
        item[name] = nest(
            [(c, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[c])) for c, x in leaves]
        )
        args[name] = nest([(c, ocp.ArrayRestoreArgs(sharding=shardings[c])) for c, _ in leaves])
    if spec["tables"]:
        item["tables"], args["tables"] = {}, {}
    for key, t in spec["tables"].items():
        arrays = {"weight": t, **t["state"], "count": None}
        item["tables"][key] = {
            f: np.zeros((), np.int32) if a is None else _abstract(a) for f, a in arrays.items()
        }
        args["tables"][key] = {f: ocp.RestoreArgs(restore_type=np.ndarray) for f in arrays}
    return item, args


def _shardings(tree: Any) -> dict:
    """Path components -> sharding of each dense leaf (key arrays: of their key data)."""
    out = {}
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]:
        for sub, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
            out[components((*path, *sub))] = leaf.sharding
    return out


def _abstract(a: Mapping) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(a["shape"]), jnp.dtype(a["dtype"]))
