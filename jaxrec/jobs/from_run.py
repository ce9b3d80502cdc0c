"""Rebuild a trained model from a ``jaxrec-train-dlrm`` run directory.

A job-layer module: it reads the job's flags (``args.json``) with the job's own
parser and builds the model with the job's builders, so it lives beside them;
``jaxrec.inference`` (below) exports whatever model it is given.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..checkpoint import CheckpointManager
from ..sparse import KeyedJaggedTensor
from ..train import init_train_state, merge_model
from .dlrm_flags import parse_config
from .dlrm_parts import build_model, build_optimizer


class RunData(NamedTuple):
    """``args.json``'s ``"data"``: the data sizes that rebuild a run's model."""

    keys: list[str]
    num_embeddings_per_feature: list[int]
    num_dense: int
    max_ids_per_sample: list[int]


def model_from_run(
    run_dir: str | os.PathLike, *, step: int | None = None
) -> tuple[nnx.Module, tuple[np.ndarray, KeyedJaggedTensor]]:
    """``(model, example_batch)`` of a ``train_dlrm`` run, at its latest checkpoint.

    The model is rebuilt unsharded from ``run_dir/args.json`` (written by the
    job) and the checkpoint restored into it (checkpoints hold logical tables,
    so a run trained on N devices restores here too). ``example_batch`` is
    ``(dense [1, num_dense], kjt)`` (``num_dense`` may be 0; export with
    ``apply_fn=click_probability``, which then feeds the constant the job
    trained with) with the run's per-feature
    ``max_ids_per_sample`` as capacities: what :func:`jaxrec.inference.export` needs.

    Args:
        run_dir: the job's ``--run-dir``.
        step: the checkpoint step (default: the latest).

    Raises:
        FileNotFoundError: no ``args.json`` (a run from before it was written)
            or no checkpoint.

    Example::

        from jaxrec import inference
        from jaxrec.jobs.from_run import click_probability, model_from_run

        model, example = model_from_run("runs/dlrm")
        inference.export(model, example, "artifacts/dlrm", apply_fn=click_probability)
    """
    run_dir = Path(run_dir)
    info_path = run_dir / "args.json"
    if not info_path.is_file():
        raise FileNotFoundError(
            f"{info_path} not found: model_from_run needs a run written by jaxrec-train-dlrm "
            "(which saves its flags there)"
        )
    info = json.loads(info_path.read_text())
    config = parse_config([]).replace_known(info["args"])  # flags it has not: defaults
    config = dataclasses.replace(config, devices=1)  # unsharded: checkpoints are plan-free
    data = RunData(*(info["data"][name] for name in RunData._fields))
    model = build_model(config, data)
    optimizer = build_optimizer(config)
    graphdef, state = init_train_state(model, optimizer)
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"no checkpoints under {ckpt_dir}")
    with CheckpointManager(ckpt_dir) as mgr:
        state = mgr.restore(graphdef, optimizer, state, step=step)
    model = merge_model(graphdef, state)
    keys, max_ids = list(data.keys), [int(n) for n in data.max_ids_per_sample]
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys, np.zeros(0, np.int32), np.zeros(len(keys), np.int32), capacities=max_ids
    )
    dense = np.zeros((1, int(data.num_dense)), np.float32)
    return model, (dense, sparse)


def click_probability(model: nnx.Module, dense: jax.Array, sparse: KeyedJaggedTensor) -> jax.Array:
    """``sigmoid(logits[:, 0])``, ``[B]``, as the job's eval step (a constant dense
    input of ones when the data has no dense features). An ``apply_fn`` for export."""
    if dense.shape[1] == 0:
        dense = jnp.ones((dense.shape[0], 1), jnp.float32)
    return jax.nn.sigmoid(model(dense, sparse)[:, 0])
