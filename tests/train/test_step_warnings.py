"""WARNING bounds checks and overflow="warn" inside a train step: step outputs, not callbacks.

A host callback in the step's program cannot be compiled without a live
backend (deviceless GPU compilation fails on it), so the step returns the
counts and the host logs them, a step or two late, with the same text.
"""

import logging
import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import sharding_cases as sc
from flax import nnx
from train_models import BagModel, mse, random_batch

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

IDS = re.compile(r"(\d+) ids out of range in (.+?) \(e\.g\. id (-?\d+)\);.*contribute zero\)$")
WEIGHTS = re.compile(r"(\d+) per-sample weights of (.+?) are NaN or infinite")
DROPPED = re.compile(r"input_dist dropped (\d+) ids that did not fit")


def callbacks(program_text: str) -> set[str]:
    """Custom-call targets that call back into Python (``xla_ffi_python_cpu_callback`` on
    CPU for ``jax.debug.callback``), in StableHLO or compiled HLO text."""
    targets = re.findall(r'custom_call @([\w.]+)|custom_call_target="([^"]+)"', program_text)
    return {t for pair in targets for t in pair if t and ("callback" in t or "python" in t)}


def jaxrec_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "jaxrec"]


def with_values(kjt, values, weights=None):
    w = kjt.weights_or_none() if weights is None else jnp.asarray(weights)
    return jr.KeyedJaggedTensor.from_parts(
        kjt.keys(),
        jnp.asarray(values),
        kjt.lengths(),
        w,
        capacities=kjt.capacity_per_key(),
        stride=kjt.stride(),
    )


# ----- the compiled step has no host callback -----


def test_the_detector_sees_a_warning_callback_outside_a_step():
    """A plain (jitted) module call keeps its callback: the detector below is not vacuous."""
    model = BagModel(rngs=nnx.Rngs(0))
    kjt, _ = random_batch(np.random.default_rng(0))
    fn = nnx.jit(lambda m, k: m.sparse["ebc"](k).values())
    assert callbacks(fn.lower(model, kjt).as_text())


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("weighted", [False, True])
def test_unsharded_step_has_no_host_callback(implementation, weighted):
    model = BagModel(weighted, rngs=nnx.Rngs(0))
    model.sparse["ebc"].implementation = implementation
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, mse, implementation=implementation)
    lowered = step.lower(state, random_batch(np.random.default_rng(0), weighted=weighted))
    assert callbacks(lowered.as_text()) == set()
    if implementation is None:  # what XLA:CPU compiles (C++ kernels included)
        assert callbacks(lowered.compile().as_text()) == set()


def sharded_setup(plan_name, *, weighted=False, **kwargs):
    gens, hosts = sc.PLANS[plan_name]
    mesh = sc.mesh_1d() if hosts == 1 else sc.mesh_2d()
    model = sc.Model(weighted, rngs=nnx.Rngs(1))
    plan = d.construct_module_sharding_plan(model.ebc, gens, world_size=8, local_size=8 // hosts)
    model = d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh, **kwargs)
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(model, opt)
    return mesh, graphdef, state, train.make_train_step(graphdef, opt, sc.loss_fn)


SHARDED_CASES = [(name, "warn") for name in sc.PLANS] + [("row_wise", "raise"), ("mixed", "exact")]


@pytest.mark.parametrize(("plan_name", "overflow"), SHARDED_CASES)
def test_sharded_step_has_no_host_callback(plan_name, overflow):
    weighted = plan_name == "mixed"  # the weights check too
    mesh, _, state, step = sharded_setup(
        plan_name, weighted=weighted, capacity=2, overflow=overflow
    )
    local, _ = sc.batches(np.random.default_rng(0), weighted=weighted)
    assert callbacks(step.lower(state, d.shard_batch(local, mesh)).as_text()) == set()


# ----- the warnings are still logged, once per bad step -----

# The lookups of BagModel as their warnings name them (t1 and t3 share one stacked
# group): where -> (feature, rows of the table it reads) per slot.
BAG_LOOKUPS = {
    "pooled lookup of ['a', 'b', 'd', 'b']": [("a", 30), ("b", 30), ("d", 16), ("b", 16)],
    "pooled lookup of ['c']": [("c", 12)],
}


def bad_ids(kjt, key, rows) -> np.ndarray:
    """Numpy reference: the valid ids of ``key`` outside ``[0, rows)``."""
    k = kjt.keys().index(key)
    start = kjt.capacity_offsets()[k]
    ids = np.asarray(kjt.values())[start : start + int(np.asarray(kjt[key].lengths()).sum())]
    return ids[(ids < 0) | (ids >= rows)]


def expected(steps, lookups) -> list[dict[str, tuple[int, set]]]:
    """Per step, ``where -> (count, bad ids)`` of its lookups that saw a bad id.

    ``steps[i]`` is a list of local KJTs (one per device, or one)."""
    out = []
    for kjts in steps:
        want = {}
        for where, slots in lookups.items():
            bad = np.concatenate([bad_ids(k, f, rows) for k in kjts for f, rows in slots])
            if bad.size:
                want[where] = (bad.size, set(bad.tolist()))
        out.append(want)
    return out


def check_id_warnings(messages, want):
    """``messages`` hold, in step order, exactly one warning per bad lookup per bad step,
    with the reference's count and one of its bad ids."""
    got = [IDS.match(m).groups() for m in messages if IDS.match(m)]
    assert len(got) == sum(len(w) for w in want), (got, want)
    for step_want in want:
        step_got, got = got[: len(step_want)], got[len(step_want) :]
        assert {w: int(c) for c, w, _ in step_got} == {w: c for w, (c, _) in step_want.items()}
        for _, where, example in step_got:
            assert int(example) in step_want[where][1], (where, example)


def poison(kjt, rng, n_bad):
    """``kjt`` with ``n_bad`` random valid ids replaced by out-of-range ones."""
    offsets = kjt.capacity_offsets()
    lengths = np.asarray(kjt.lengths()).reshape(len(kjt.keys()), -1).sum(axis=1)
    positions = [offsets[k] + j for k in range(len(kjt.keys())) for j in range(lengths[k])]
    values = np.asarray(kjt.values()).copy()
    for p in rng.choice(positions, size=n_bad, replace=False):
        values[p] = -int(rng.integers(1, 5)) if rng.random() < 0.5 else int(rng.integers(50, 99))
    return with_values(kjt, values)


def unsharded_setup(implementation=None):
    model = BagModel(True, rngs=nnx.Rngs(0))
    model.sparse["ebc"].implementation = implementation
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(model, opt)
    return state, train.make_train_step(graphdef, opt, mse, implementation=implementation)


def unsharded_batches(seed, bad_counts):
    rng = np.random.default_rng(seed)
    out = []
    for n_bad in bad_counts:
        kjt, y = random_batch(rng, weighted=True)
        out.append((poison(kjt, rng, n_bad) if n_bad else kjt, y))
    return out


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_unsharded_step_logs_each_bad_step_once(implementation, caplog):
    batches = unsharded_batches(0, [0, 3, 0, 1, 4, 0])
    kjt, y = batches[4]  # a NaN weight too: the weights check reports through the step
    weights = np.asarray(kjt.weights()).copy()
    assert int(np.asarray(kjt["b"].lengths()).sum()) > 0
    weights[kjt.capacity_offsets()[1]] = np.nan  # the first id of key 'b'
    batches[4] = (with_values(kjt, kjt.values(), weights), y)
    state, step = unsharded_setup(implementation)
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        for i, batch in enumerate(batches):
            state, loss, _ = step(state, batch)
            if i == 3:  # step 1's warnings: logged two steps later at the latest, unflushed
                assert any(IDS.match(m) for m in jaxrec_warnings(caplog))
        assert np.isfinite(float(loss))
        step.flush_warnings()
        messages = jaxrec_warnings(caplog)
    check_id_warnings(messages, expected([[k] for k, _ in batches], BAG_LOOKUPS))
    weights = [WEIGHTS.match(m).groups() for m in messages if WEIGHTS.match(m)]
    assert weights == [("1", "pooled lookup of ['a', 'b', 'd', 'b']")]
    assert all(IDS.match(m) or WEIGHTS.match(m) for m in messages), messages
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxrec"):  # nothing is logged twice
        step.flush_warnings()
        state, _, _ = step(state, batches[0])
        step.flush_warnings()
    assert jaxrec_warnings(caplog) == []


def test_pipeline_logs_each_bad_step_once(caplog):
    batches = unsharded_batches(1, [2, 0, 0, 5, 1])
    state, step = unsharded_setup()
    pipeline = train.TrainPipeline(step, state, to_device=lambda b: b)
    it = iter(batches)
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        with pytest.raises(StopIteration):
            while True:
                pipeline.progress(it)
        messages = jaxrec_warnings(caplog)  # the loader's end flushed them
    check_id_warnings(messages, expected([[k] for k, _ in batches], BAG_LOOKUPS))
    assert all(IDS.match(m) for m in messages), messages


def expected_dropped(model, local_kjts, capacity) -> int:
    """Numpy reference of row-wise overflow: per source device, group and destination
    rank, the valid ids whose rows that rank holds, beyond ``capacity``."""
    total = 0
    for kjt in local_kjts:
        caps = dict(zip(kjt.keys(), kjt.capacity_per_key(), strict=True))
        for g in model.ebc.layout.groups:
            natural = max(1, max(sum(caps[s.key] for s in slots) for slots in g.slots))
            cap = min(capacity, natural)
            for slots in g.slots:
                sent = 0
                for s in slots:
                    ids = bad_ids(kjt, s.key, 0)  # every valid id (none is in [0, 0))
                    sent += int(np.sum((ids >= s.row0) & (ids < s.row0 + s.nrows)))
                total += max(sent - cap, 0)
    return total


def test_sharded_row_wise_step_logs_ids_and_overflow(caplog):
    capacity = 3
    mesh, graphdef, state, step = sharded_setup("row_wise", capacity=capacity, overflow="warn")
    rng = np.random.default_rng(5)
    steps = []
    for n_bad in ([0, 2, 0, 0, 1, 0, 0, 0], [0] * 8, [3, 0, 0, 0, 0, 0, 0, 2]):
        local, _ = sc.batches(rng)
        steps.append(
            [(poison(k, rng, n) if n else k, y) for (k, y), n in zip(local, n_bad, strict=True)]
        )
    lookups = {
        f"sharded lookup of {f!r} in table {t.name!r}": [(f, t.num_embeddings)]
        for t in sc.tables()
        for f in t.feature_names
    }
    model = train.merge_model(graphdef, state)
    want_dropped = [expected_dropped(model, [k for k, _ in s], capacity) for s in steps]
    assert all(want_dropped), want_dropped  # every step overflows
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        for local in steps:
            state, _, _ = step(state, d.shard_batch(local, mesh))
        step.flush_warnings()
        messages = jaxrec_warnings(caplog)
    check_id_warnings(messages, expected([[k for k, _ in s] for s in steps], lookups))
    assert [int(DROPPED.match(m).group(1)) for m in messages if DROPPED.match(m)] == want_dropped
    counted = train.merge_model(graphdef, state).ebc.overflow_count.get_value()
    assert int(np.asarray(counted).sum()) == sum(want_dropped)


REROUTED = re.compile(r"input_dist sent (\d+) ids beyond the per-destination capacity")


def test_exact_overflow_is_counted_and_logged_once_a_minute(caplog, monkeypatch):
    """``overflow="exact"`` (the default) loses nothing; ids beyond the fast path are
    counted, and logged by the host at most once a minute (they cost time every step)."""
    from jaxrec.embedding import tape

    monkeypatch.setattr(tape, "_LAST_REROUTE_LOG", [-float("inf")])
    capacity = 3
    mesh, graphdef, state, step = sharded_setup("row_wise", capacity=capacity)
    rng = np.random.default_rng(5)
    steps = [sc.batches(rng)[0] for _ in range(3)]
    model = train.merge_model(graphdef, state)
    beyond = [expected_dropped(model, [k for k, _ in s], capacity) for s in steps]
    assert all(beyond), beyond
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        for local in steps:
            state, _, _ = step(state, d.shard_batch(local, mesh))
        step.flush_warnings()
        messages = jaxrec_warnings(caplog)
    assert [int(REROUTED.match(m).group(1)) for m in messages if REROUTED.match(m)] == beyond[:1]
    assert not any(DROPPED.match(m) for m in messages)
    counted = train.merge_model(graphdef, state).ebc.overflow_count.get_value()
    assert int(np.asarray(counted).sum()) == sum(beyond)
