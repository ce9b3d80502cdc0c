"""CheckpointManager: keep-last-N, resume from the latest step, metadata, intervals,
the on-disk layout, and clear errors for checkpoints that do not fit the target."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorstore as ts
from checkpoint_cases import TablesModel, leaves, tables
from flax import nnx

import jaxrec as jr
from jaxrec import checkpoint as ckpt
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

OPT = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))


def init(configs=None, opt=OPT, dropout=True):
    model = TablesModel(configs or tables(), rngs=nnx.Rngs(2), dropout=dropout)
    return train.init_train_state(model, opt)


def bumped(state, k):
    """A state with every value changed by ``k`` (keys folded with ``k``)."""

    def bump(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.fold_in(x, k)
        return x + k

    return jax.tree.map(bump, state)


def test_keep_last_n_resume_and_metadata(tmp_path):
    graphdef, state = init()
    saved = {}
    with ckpt.CheckpointManager(tmp_path, max_to_keep=2) as mgr:  # async by default
        for step in range(1, 5):
            saved[step] = bumped(state, step)
            assert mgr.save(step, graphdef, OPT, saved[step], metadata={"epoch": step // 2})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4]

    mgr = ckpt.CheckpointManager(tmp_path)  # a restarted run
    assert mgr.latest_step() == 4 and mgr.metadata() == {"epoch": 2}
    restored, step = mgr.resume(graphdef, OPT, state)
    assert step == 4
    for x, y in zip(leaves(restored), leaves(saved[4]), strict=True):
        np.testing.assert_array_equal(x, y)
    key = restored.rest["drop"]["rngs"]["key"].get_value()
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)  # a typed key again
    older = mgr.restore(graphdef, OPT, state, step=3)
    for x, y in zip(leaves(older), leaves(saved[3]), strict=True):
        np.testing.assert_array_equal(x, y)
    assert mgr.metadata(3) == {"epoch": 1}
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 1 .* steps: \[3, 4\]"):
        mgr.restore(graphdef, OPT, state, step=1)
    mgr.close()


def test_fresh_directory_resumes_at_zero(tmp_path):
    graphdef, state = init()
    with ckpt.CheckpointManager(tmp_path / "new") as mgr:
        resumed, step = mgr.resume(graphdef, OPT, state)
        assert step == 0 and resumed is state and mgr.latest_step() is None
        with pytest.raises(FileNotFoundError, match="no checkpoint in"):
            mgr.restore(graphdef, OPT, state)


def test_save_interval_force_and_bad_metadata(tmp_path):
    graphdef, state = init(dropout=False)
    with ckpt.CheckpointManager(tmp_path, save_interval_steps=2, async_save=False) as mgr:
        assert mgr.save(1, graphdef, OPT, state)  # the first save of a run always happens
        assert not mgr.save(3, graphdef, OPT, state)
        assert mgr.save(4, graphdef, OPT, state)
        assert not mgr.save(4, graphdef, OPT, state)  # not after the latest saved step
        assert not mgr.save(5, graphdef, OPT, state)
        assert mgr.save(5, graphdef, OPT, state, force=True)
        assert mgr.all_steps() == [1, 4, 5]
        with pytest.raises(TypeError, match="metadata must be JSON-serialisable"):
            mgr.save(6, graphdef, OPT, state, metadata={"x": object()})


def test_on_disk_tables_are_logical(tmp_path):
    """A table is stored in natural row order, in its dtype (here bf16), with its
    optimizer state: plain TensorStore reads it back from the index in meta.json."""
    configs = tables()
    configs[1] = dataclasses.replace(configs[1], data_type=jr.DataType.BF16)
    graphdef, state = init(configs, dropout=False)
    state = bumped(state, 3)
    with ckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(7, graphdef, OPT, state)
        restored = mgr.restore(graphdef, OPT, state)
    for x, y in zip(leaves(restored), leaves(state), strict=True):
        np.testing.assert_array_equal(x, y)
    with open(tmp_path / "7" / "meta.json") as f:
        entry = json.load(f)["meta"]["tables"]["ebc.embedding_bags.t2"]
    assert entry["count"] == 3 and sorted(entry["pieces"]) == ["momentum1", "weight"]

    def read(field):
        [(row, rows, col, cols, _)] = entry["pieces"][field]  # unsharded: one piece
        path = tmp_path / "7" / "tables" / str(entry["id"]) / field / f"{row}_{col}"
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
        return ts.open(spec).result().read().result()

    model = train.merge_model(graphdef, state)
    weight = model.ebc.state_dict()["embedding_bags.t2.weight"]
    assert read("weight").dtype == weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(read("weight"), weight)
    np.testing.assert_array_equal(read("momentum1"), np.full(37, 3.0, np.float32))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of the four-table model (row-wise Adagrad, dense Adam)."""
    path = tmp_path_factory.mktemp("mismatch")
    graphdef, state = init(dropout=False)
    with ckpt.CheckpointManager(path, async_save=False) as mgr:
        mgr.save(0, graphdef, OPT, state)
    return path


def _restore(path, configs=None, opt=OPT):
    graphdef, state = init(configs, opt, dropout=False)
    with ckpt.CheckpointManager(path) as mgr:
        return mgr.restore(graphdef, opt, state)


def test_missing_and_extra_tables(saved):
    configs = tables()[:3] + [dataclasses.replace(tables()[3], name="t5")]
    pattern = (
        r"(?s)checkpoint step 0 in .* does not match the target state"
        r".*tables missing from .*\['ebc.embedding_bags.t5'\]"
        r".*tables in .* that the target does not have: \['ebc.embedding_bags.t4'\]"
    )
    with pytest.raises(ValueError, match=pattern):
        _restore(saved, configs)


def test_shape_mismatch(saved):
    configs = tables()
    configs[1] = dataclasses.replace(configs[1], embedding_dim=5)
    pattern = (
        r"(?s)table ebc.embedding_bags.t2: float32\[37, 6\] in checkpoint .*, the target has "
        r"float32\[37, 5\].*params leaf head/kernel/value: float32\[34, 1\]"
    )
    with pytest.raises(ValueError, match=pattern):
        _restore(saved, configs)


def test_optimizer_mismatch(saved):
    opt = CombinedOptimizer(optax.sgd(0.1), optim.adam(0.1))
    pattern = (
        r"(?s)table ebc.embedding_bags.t1: optimizer EXACT_ROWWISE_ADAGRAD in .*, the target "
        r"uses ADAM.*optimizer state fields \{momentum1: float32\[50\]\} in .* has "
        r"\{momentum1: float32\[50, 8\], momentum2: float32\[50, 8\]\}"
        r".*dense_opt leaves in checkpoint .* that the target does not have"
    )
    with pytest.raises(ValueError, match=pattern):
        _restore(saved, opt=opt)
