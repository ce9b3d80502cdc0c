"""Damaged checkpoints: every fault is an error naming the step, the array and the file, and
``resume`` falls back to the newest intact step with a warning. Format 1 steps are read."""

import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_cases import leaves
from flax import nnx
from test_checkpoint_manager import OPT, bumped, init

from jaxrec import checkpoint as ckpt
from jaxrec import train


def _flip(path, at=-7):
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_END if at < 0 else os.SEEK_SET)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


def _truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def _table_chunk(step_dir, field="weight"):
    return sorted(
        glob.glob(os.path.join(step_dir, "tables", "0", field, "*", "c", "**", "*"), recursive=True)
    )[-1]


def _dense_chunk(step_dir):
    files = glob.glob(os.path.join(step_dir, "dense", "params", "*", "c", "**"), recursive=True)
    return sorted(f for f in files if os.path.isfile(f))[-1]


DAMAGE = {  # name: (damage(step_dir) -> the damaged file, what the error says)
    "bit flip in a table": (lambda d: _flip(p := _table_chunk(d)) or p, "Digest mismatch"),
    "bit flip in an optimizer state": (
        lambda d: _flip(p := _table_chunk(d, "momentum1"), at=5) or p,
        "Digest mismatch",
    ),
    "truncated table chunk": (lambda d: _truncate(p := _table_chunk(d)) or p, "Not enough data"),
    "deleted table chunk": (lambda d: os.remove(p := _table_chunk(d)) or p, "is missing"),
    "deleted piece metadata": (
        lambda d: (
            os.remove(p := glob.glob(f"{d}/tables/0/weight/*/zarr.json")[0]) or os.path.dirname(p)
        ),
        "cannot open",
    ),
    "bit flip in a dense leaf": (lambda d: _flip(p := _dense_chunk(d)) or p, "Digest mismatch"),
    "bit flip in meta.json": (
        lambda d: _flip(p := os.path.join(d, "meta.json"), at=200) or p,
        "meta.json",
    ),
    "deleted meta.json": (lambda d: os.remove(p := os.path.join(d, "meta.json")) or p, "missing"),
}


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """Steps 1 and 2 of the four-table model (values init+1 and init+2) and the target."""
    path = tmp_path_factory.mktemp("faults")
    graphdef, state = init(dropout=False)
    with ckpt.CheckpointManager(path, async_save=False) as mgr:
        for k in (1, 2):
            mgr.save(k, graphdef, OPT, bumped(state, k))
    return path, graphdef, state


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damage_is_named_and_resume_falls_back(two_steps, tmp_path, damage):
    saved, graphdef, state = two_steps
    shutil.copytree(saved, tmp_path / "ckpt")
    hurt, says = DAMAGE[damage]
    damaged = hurt(str(tmp_path / "ckpt" / "2"))
    mgr = ckpt.CheckpointManager(tmp_path / "ckpt")
    with pytest.raises(ckpt.CheckpointCorruptError) as err:
        mgr.restore(graphdef, OPT, state, step=2)
    message = str(err.value)
    assert says in message and damaged in message, message
    assert "step 2" in message or os.path.join("ckpt", "2", "meta.json") in message, message
    with pytest.warns(ckpt.CheckpointWarning, match="skipping damaged checkpoint step 2"):
        restored, step = mgr.resume(graphdef, OPT, state)
    assert step == 1
    for x, y in zip(leaves(restored), leaves(bumped(state, 1)), strict=True):
        np.testing.assert_array_equal(x, y)


def test_every_step_damaged_is_an_error(two_steps, tmp_path):
    saved, graphdef, state = two_steps
    shutil.copytree(saved, tmp_path / "ckpt")
    for step in ("1", "2"):
        _flip(_table_chunk(str(tmp_path / "ckpt" / step)))
    mgr = ckpt.CheckpointManager(tmp_path / "ckpt")
    every = r"every checkpoint .* is damaged:\n  step 2: .*\n  step 1"
    with (
        pytest.warns(ckpt.CheckpointWarning),
        pytest.raises(ckpt.CheckpointCorruptError, match=every),
    ):
        mgr.resume(graphdef, OPT, state)


def _tables_drawn_before_philox(graphdef, state):
    """``state`` with its tables as jaxrec drew them when format 1 was written (before
    2026-11-28): value ``e`` of table ``i`` (row-major) was element ``e % 16384`` of
    ``jax.random.uniform(fold_in(fold_in(key, i), e // 16384), (16384,), lo, hi)``."""
    model = train.merge_model(graphdef, state)
    ebc = model.ebc
    key = nnx.Rngs(0).params()  # TablesModel's collection: Rngs(0), its first draw
    old = {}
    for i, t in enumerate(ebc.table_configs):
        n = t.num_embeddings * t.embedding_dim
        chunks = [
            jax.random.uniform(
                jax.random.fold_in(jax.random.fold_in(key, i), c),
                (16384,),
                jnp.float32,
                t.get_weight_init_min(),
                t.get_weight_init_max(),
            )
            for c in range(-(-n // 16384))
        ]
        flat = np.concatenate([np.asarray(c) for c in chunks])[:n]
        old[f"embedding_bags.{t.name}.weight"] = flat.reshape(t.num_embeddings, t.embedding_dim)
    ebc.load_state_dict(old)
    return train.init_train_state(model, OPT)[1]


def test_format_1_steps_are_read(tmp_path):
    """A step written by jaxrec's orbax format (tests/checkpoint/data/format1: the
    four-table model at init+3, step 5, its tables drawn by jaxrec's generator of
    then) restores; the next save writes format 2."""
    shutil.copytree(os.path.join(os.path.dirname(__file__), "data", "format1"), tmp_path / "c")
    graphdef, state = init(dropout=False)
    state = _tables_drawn_before_philox(graphdef, state)
    with ckpt.CheckpointManager(tmp_path / "c", async_save=False) as mgr:
        assert mgr.all_steps() == [5] and mgr.metadata() == {"epoch": 1}
        restored, step = mgr.resume(graphdef, OPT, state)
        assert step == 5
        for x, y in zip(leaves(restored), leaves(bumped(state, 3)), strict=True):
            np.testing.assert_array_equal(x, y)
        assert mgr.save(6, graphdef, OPT, restored)
        again = mgr.restore(graphdef, OPT, state)
    with open(tmp_path / "c" / "6" / "meta.json") as f:
        assert json.load(f)["meta"]["format"] == "jaxrec.checkpoint/2"
    for x, y in zip(leaves(again), leaves(restored), strict=True):
        np.testing.assert_array_equal(x, y)
