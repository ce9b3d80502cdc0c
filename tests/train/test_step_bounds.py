"""``BoundsCheckMode.FATAL`` inside a donated train step: an error that carries a usable state."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from test_step_guard import assert_bitwise_equal, host
from train_models import bag_tables, mse, random_batch

import jaxrec as jr
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

FATAL = jr.BoundsCheckMode.FATAL


class FatalModel(nnx.Module):
    def __init__(self, *, rngs):
        self.ebc = jr.EmbeddingBagCollection(bag_tables(), rngs=rngs, bounds_check_mode=FATAL)
        self.head = nnx.Linear(24, 1, rngs=rngs)

    def __call__(self, kjt):
        return self.head(self.ebc(kjt).values())[:, 0]


def with_bad_id(kjt, key, bad_id):
    """``kjt`` with the first id of feature ``key`` replaced by ``bad_id``."""
    start = kjt.capacity_offsets()[kjt.keys().index(key)]
    assert int(kjt[key].lengths().sum()) > 0
    values = kjt.values().at[start].set(bad_id)
    return jr.KeyedJaggedTensor.from_parts(
        kjt.keys(), values, kjt.lengths(), capacities=kjt.capacity_per_key(), stride=kjt.stride()
    )


OPTIMIZERS = {
    "rowwise_adagrad": (lambda: optim.rowwise_adagrad(0.1), None),  # C++ lookup + update
    "adam_xla": (lambda: optim.adam(0.05), "xla"),
}


def setup(opt_name):
    sparse, implementation = OPTIMIZERS[opt_name]
    opt = CombinedOptimizer(optax.adam(0.01), sparse())
    graphdef, state = train.init_train_state(FatalModel(rngs=nnx.Rngs(0)), opt)
    return graphdef, state, train.make_train_step(graphdef, opt, mse, implementation=implementation)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_fatal_out_of_range_id_raises_with_the_unchanged_state(opt_name):
    rng = np.random.default_rng(0)
    good1, good2 = random_batch(rng), random_batch(rng)
    kjt, y = random_batch(rng)
    bad = (with_bad_id(kjt, "c", 12), y)  # t2 has 12 rows
    _, state, step = setup(opt_name)
    state, _, _ = step(state, good1)
    before = host(state)
    with pytest.raises(train.BoundsCheckError, match=r"1 ids out of range .*'c'.*id 12") as err:
        step(state, bad)
    assert isinstance(err.value, ValueError)
    assert (err.value.count, err.value.example) == (1, 12)
    assert "'c'" in err.value.where
    assert_bitwise_equal(host(err.value.state), before)  # usable, nothing deleted or applied
    state, _, _ = step(err.value.state, good2)

    _, ref, ref_step = setup(opt_name)
    for b in (good1, good2):
        ref, _, _ = ref_step(ref, b)
    assert_bitwise_equal(host(state), host(ref))


def test_fatal_counts_every_bad_id_and_fatal_outside_a_step_still_raises():
    rng = np.random.default_rng(1)
    kjt, y = random_batch(rng)
    kjt = with_bad_id(with_bad_id(with_bad_id(kjt, "a", -3), "d", 16), "c", 99)
    _, state, step = setup("rowwise_adagrad")
    with pytest.raises(train.BoundsCheckError) as err:
        step(state, (kjt, y))
    # One entry per lookup (table group): a and d share one, c has its own.
    counts = {w: c for w, (c, _) in err.value.failures.items()}
    assert sorted(counts.values()) == [1, 2], counts
    assert "id -3" in str(err.value) and "id 99" in str(err.value)
    # Outside a train step, FATAL raises from the lookup as before.
    model = train.merge_model(*setup("rowwise_adagrad")[:2])
    with pytest.raises(jax.errors.JaxRuntimeError, match="out of range"):
        jax.block_until_ready(nnx.jit(lambda m, k: m.ebc(k).values())(model, kjt))


def test_pipeline_raises_fatal_with_a_usable_state():
    """The pipeline reads the report one step late: the bad batch is not applied, the next is."""
    rng = np.random.default_rng(2)
    good1, good2, good3 = (random_batch(rng) for _ in range(3))
    kjt, y = random_batch(rng)
    bad = (with_bad_id(kjt, "b", 40), y)
    _, state, step = setup("rowwise_adagrad")
    pipeline = train.TrainPipeline(step, state, to_device=lambda b: b)
    it = iter([good1, bad, good2, good3])
    pipeline.progress(it)
    pipeline.progress(it)
    with pytest.raises(train.BoundsCheckError, match="id 40") as err:
        pipeline.progress(it)
    pipeline.close()
    _, ref, ref_step = setup("rowwise_adagrad")
    for b in (good1, good2):
        ref, _, _ = ref_step(ref, b)
    assert_bitwise_equal(host(err.value.state), host(ref))
    assert_bitwise_equal(host(pipeline.state), host(ref))
