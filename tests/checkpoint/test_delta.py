"""Delta checkpoints (``jaxrec.checkpoint.ModelDeltaTracker``): a full checkpoint plus the
deltas published after it rebuild the trained state bit for bit, under any plan.

The reference is independent of the marks: the rows each delta must hold are the
distinct ids of the batches trained since the previous link, counted in numpy.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from checkpoint_cases import batch, build, host, loss_fn, samples
from flax import nnx

import jaxrec as jr
from jaxrec import checkpoint as ckpt
from jaxrec import optim, train
from jaxrec.checkpoint import delta as delta_module
from jaxrec.embedding import CombinedOptimizer, track_touched_rows

ROWS = {"big": 4000, "small": 300}
KEYS = ("f1", "f2", "f3")
B, MAX_LEN = 16, 4


class Model(nnx.Module):
    """Two tables in one group (dim 8): ``big`` reads f1 and f2, ``small`` reads f1 (a
    shared feature) and f3; ``small`` has another optimizer (two states per group)."""

    def __init__(self):
        self.ebc = jr.EmbeddingBagCollection(
            [
                jr.EmbeddingBagConfig(
                    name="big",
                    embedding_dim=8,
                    num_embeddings=ROWS["big"],
                    feature_names=["f1", "f2"],
                ),
                jr.EmbeddingBagConfig(
                    name="small",
                    embedding_dim=8,
                    num_embeddings=ROWS["small"],
                    feature_names=["f1", "f3"],
                    pooling=jr.PoolingType.MEAN,
                ),
            ],
            rngs=nnx.Rngs(0),
        )
        self.head = nnx.Linear(32, 1, rngs=nnx.Rngs(1))

    def __call__(self, kjt):
        return self.head(self.ebc(kjt).values())[:, 0]


def zipf_batch(seed: int):
    """Zipf-skewed ids (a few hot rows, a long tail): ``(kjt, y)`` and the ids per key."""
    rng = np.random.default_rng(seed)
    bound = {"f1": ROWS["small"], "f2": ROWS["big"], "f3": ROWS["small"]}
    bags = {
        k: [(rng.zipf(1.3, int(rng.integers(0, MAX_LEN + 1))) - 1) % bound[k] for _ in range(B)]
        for k in KEYS
    }
    lengths = [len(b) for k in KEYS for b in bags[k]]
    values = [int(i) for k in KEYS for b in bags[k] for i in b]
    kjt = jr.KeyedJaggedTensor.from_lengths_sync(
        list(KEYS), values, lengths, capacities={k: B * MAX_LEN for k in KEYS}
    )
    y = jnp.asarray(rng.normal(size=B).astype(np.float32))
    return (kjt, y), {k: np.concatenate(bags[k]).astype(np.int64) for k in KEYS}


def mse(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def expected_rows(ids_per_batch) -> dict[str, int]:
    """Distinct rows of each table the batches looked up (the reference of a delta)."""
    big = np.unique(np.concatenate([np.concatenate([b["f1"], b["f2"]]) for b in ids_per_batch]))
    small = np.unique(np.concatenate([np.concatenate([b["f1"], b["f3"]]) for b in ids_per_batch]))
    return {"ebc.embedding_bags.big": len(big), "ebc.embedding_bags.small": len(small)}


OPT = CombinedOptimizer(
    optax.adam(0.01), optim.adam(0.05), per_table={"small": optim.rowwise_adagrad(0.1)}
)


def tracked_plain():
    graphdef, state = train.init_train_state(track_touched_rows(Model()), OPT)
    return graphdef, state


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """2 steps, a full save, then 3 publishes 2 steps apart; the final state and rows."""
    directory = str(tmp_path_factory.mktemp("delta_plain"))
    graphdef, state = tracked_plain()
    step = train.make_train_step(graphdef, OPT, mse)
    data = [zipf_batch(i) for i in range(8)]
    for b, _ in data[:2]:
        state, _, _ = step(state, b)
    tracker = ckpt.ModelDeltaTracker(ckpt.CheckpointManager(directory, async_save=False))
    state = tracker.save_base(2, graphdef, OPT, state).state
    published = []
    for i in range(2, 8):
        state, _, _ = step(state, data[i][0])
        if i % 2 == 1:
            pub = tracker.publish(i + 1, graphdef, OPT, state)
            state = pub.state
            published.append((pub, expected_rows([d[1] for d in data[i - 1 : i + 1]])))
    return directory, graphdef, host(ckpt.logical_state(graphdef, OPT, state)), published, step


def test_base_plus_deltas_is_the_trained_state_bitwise(plain_run):
    directory, graphdef, final, _, _ = plain_run
    _, target = tracked_plain()
    tracker = ckpt.ModelDeltaTracker(ckpt.CheckpointManager(directory))
    restored, link = tracker.restore(graphdef, OPT, target)
    assert link.kind == "delta" and link.step == 8
    got = host(ckpt.logical_state(graphdef, OPT, restored))
    assert sorted(got) == sorted(final)
    for k in final:
        np.testing.assert_array_equal(got[k], final[k], err_msg=k)


def test_delta_holds_the_touched_rows_only(plain_run):
    directory, _, _, published, _ = plain_run
    for pub, want in published:
        assert pub.rows == want
        assert all(n < ROWS[k.rsplit(".", 1)[1]] for k, n in want.items())  # a real delta
        with open(os.path.join(directory, "deltas", str(pub.link.step), "meta.json")) as f:
            meta = json.load(f)["meta"]
        for key, n in want.items():
            for field, pieces in meta["tables"][key]["pieces"].items():
                assert sum(p[1] for p in pieces) == n, (key, field)


def test_a_delta_missing_a_row_is_caught(plain_run, tmp_path, monkeypatch):
    """The comparison above can fail: a tracker that drops one touched id restores a
    state that differs from the trained one."""
    real = delta_module.touched_ids

    def drop_one(graphdef, state, **kwargs):
        ids = real(graphdef, state, **kwargs)
        key = "ebc.embedding_bags.big"
        return {**ids, key: ids[key][1:]}

    graphdef, state = tracked_plain()
    step = plain_run[-1]  # the same model and optimizer: compiled once
    tracker = ckpt.ModelDeltaTracker(ckpt.CheckpointManager(str(tmp_path), async_save=False))
    state = tracker.save_base(1, graphdef, OPT, state).state
    state, _, _ = step(state, zipf_batch(0)[0])
    monkeypatch.setattr(delta_module, "touched_ids", drop_one)
    state = tracker.publish(2, graphdef, OPT, state).state
    final = host(ckpt.logical_state(graphdef, OPT, state))
    _, target = tracked_plain()
    restored, _ = tracker.restore(graphdef, OPT, target)
    got = host(ckpt.logical_state(graphdef, OPT, restored))
    differ = {k for k in final if not np.array_equal(got[k], final[k])}
    big = {k for k in final if k.startswith("ebc.embedding_bags.big.") and k[-6:] != ".count"}
    assert differ == big  # the dropped row of the weight and of each Adam moment


def test_refuses_a_delta_on_the_wrong_base(plain_run):
    directory, graphdef, _, published, _ = plain_run
    _, target = tracked_plain()
    tracker = ckpt.ModelDeltaTracker(ckpt.CheckpointManager(directory))
    base = tracker.full_link(2)
    state = tracker.manager.restore(graphdef, OPT, target, step=2)
    second = published[1][0].link.step
    with pytest.raises(ValueError, match="apply deltas in order"):  # one skipped
        tracker.apply_delta(second, graphdef, OPT, state, after=base)
    state, at = tracker.apply_delta(published[0][0].link.step, graphdef, OPT, state, after=base)
    with pytest.raises(ValueError, match="apply deltas in order"):  # applied twice
        tracker.apply_delta(at.step, graphdef, OPT, state, after=at)
    forged = base._replace(digest="0" * 64)  # the same step of another run
    with pytest.raises(ValueError, match="sha256 000000000000"):
        tracker.apply_delta(published[0][0].link.step, graphdef, OPT, state, after=forged)


def test_a_damaged_delta_index_is_refused(plain_run, tmp_path):
    directory, graphdef, _, published, _ = plain_run
    step = published[0][0].link.step
    path = os.path.join(directory, "deltas", str(step), "meta.json")
    with open(path) as f:
        raw = json.load(f)
    raw["meta"]["tables"]["ebc.embedding_bags.big"]["count"] += 1
    copy = tmp_path / "run"
    os.makedirs(copy / "deltas" / str(step))
    os.symlink(os.path.join(directory, "2"), copy / "2")
    with open(copy / "deltas" / str(step) / "meta.json", "w") as f:
        json.dump(raw, f)
    tracker = ckpt.ModelDeltaTracker(ckpt.CheckpointManager(str(copy)))
    with pytest.raises(ckpt.CheckpointCorruptError, match="checksum mismatch"):
        tracker.restore(graphdef, OPT, tracked_plain()[1])


def test_publish_needs_marks_and_a_base(tmp_path):
    graphdef, state = train.init_train_state(Model(), OPT)  # not tracked
    tracker = ckpt.ModelDeltaTracker(ckpt.CheckpointManager(str(tmp_path), async_save=False))
    with pytest.raises(ValueError, match="call save_base"):
        tracker.publish(1, graphdef, OPT, state)
    state = tracker.save_base(1, graphdef, OPT, state).state
    with pytest.raises(ValueError, match="track_touched_rows"):
        tracker.publish(2, graphdef, OPT, state)


# ----- sharded: train row-wise on 8 devices, restore under other plans -----


def tracked(layout: str, opt):
    graphdef, state, mesh = build(layout, opt)
    model = track_touched_rows(train.merge_model(graphdef, state))
    graphdef, state = train.init_train_state(model, opt)
    return graphdef, state, mesh


def test_sharded_deltas_restore_under_other_plans(tmp_path):
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    graphdef, state, mesh = tracked("row_wise_8", opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    tracker = ckpt.ModelDeltaTracker(ckpt.CheckpointManager(str(tmp_path), async_save=False))
    state, _, _ = step(state, batch(samples(0), mesh))
    state = tracker.save_base(1, graphdef, opt, state).state
    for i in (1, 2):
        state, _, _ = step(state, batch(samples(i), mesh))
        pub = tracker.publish(i + 1, graphdef, opt, state)
        state = pub.state
        bags, _ = samples(i)  # the reference: rows of t1 (f1, f2) looked up this step
        t1 = {x for k in ("f1", "f2") for bag in bags[k] for x in bag}
        assert pub.rows["ebc.embedding_bags.t1"] == len(t1)
    final = host(ckpt.logical_state(graphdef, opt, state))
    g, target, _ = tracked("table_wise_4", opt)  # another plan, 4 devices
    restored, link = ckpt.ModelDeltaTracker(tracker.manager).restore(g, opt, target)
    assert link.step == 3
    got = host(ckpt.logical_state(g, opt, restored))
    assert sorted(got) == sorted(final)
    for k in final:
        np.testing.assert_array_equal(got[k], final[k], err_msg=k)


@pytest.mark.parametrize("kind", ["accumulate", "semi_sync"])
def test_accumulating_and_semi_sync_steps_mark_every_trained_row(kind):
    """The marks ride in ``rest``: an accumulating step (every micro-batch) and a
    semi-synchronous step (the batch it trains, not the one it looks up ahead) mark
    exactly the distinct ids they train on."""
    graphdef, state = tracked_plain()
    data = [zipf_batch(10 + i) for i in range(4)]
    if kind == "accumulate":
        step = train.make_accumulating_train_step(graphdef, OPT, mse, micro_batches=2)
        state, _, _ = step(state, train.stack_micro_batches([data[0][0], data[1][0]]))
        trained = [data[0][1], data[1][1]]
    else:
        step = train.make_semi_sync_train_step(graphdef, OPT, mse)
        looked = step.lookup(state, data[0][0])
        for j in range(2):  # trains batches 0 and 1; batch 2 is only looked up
            state, _, _, looked = step(state, looked, data[j][0], data[j + 1][0])
        trained = [data[0][1], data[1][1]]
    model = train.merge_model(graphdef, state)
    got = {
        f"ebc.embedding_bags.{t}": int(np.sum(np.asarray(model.ebc.touched_rows[t].get_value())))
        for t in ROWS
    }
    assert got == expected_rows(trained)
