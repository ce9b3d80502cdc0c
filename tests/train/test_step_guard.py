"""The non-finite guard (``skip_nonfinite=True``): a bad step changes no state and is counted."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_eviction_reset import FILL, NAMES, K, ResetModel, no_resets
from test_eviction_reset import loss_fn as reset_loss
from test_train_step import _abstract_step
from train_models import SeqModel, bag_tables, random_batch

import jaxrec as jr
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

OPTIMIZERS = {  # (sparse optimizer, implementation): the C++ KJT kernel, XLA fused, XLA rows
    "rowwise_adagrad": (lambda: optim.rowwise_adagrad(0.1), None),
    "rowwise_adagrad_xla": (lambda: optim.rowwise_adagrad(0.1), "xla"),
    "adam": (lambda: optim.adam(0.05), None),
}


class DenseModel(nnx.Module):
    """EBC + a dense feature -> linear (a NaN/inf can enter through either)."""

    def __init__(self, *, rngs):
        self.ebc = jr.EmbeddingBagCollection(bag_tables(), rngs=rngs)
        self.head = nnx.Linear(24 + 3, 1, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))  # in ``rest``

    def __call__(self, kjt, x):
        self.calls.set_value(self.calls.get_value() + 1)
        return self.head(jnp.concatenate([self.ebc(kjt).values(), x], axis=1))[:, 0]


def loss(model, batch):
    kjt, x, y = batch
    return jnp.mean((model(kjt, x) - y) ** 2)


def nan_grad_loss(model, batch):
    """A finite loss whose gradient w.r.t. the embedding output is NaN (sqrt at 0, times 0)."""
    kjt, x, y = batch
    pooled = model.ebc(kjt).values()
    pred = model.head(jnp.concatenate([pooled, x], axis=1))[:, 0]
    return jnp.mean((pred - y) ** 2) + jnp.sum(jnp.sqrt(jnp.abs(pooled) * 0.0))


def batch(rng):
    kjt, y = random_batch(rng)
    return kjt, jnp.asarray(rng.normal(size=(6, 3)), jnp.float32), y


def host(state):
    """A host copy of every leaf (the step donates the device buffers)."""
    return jax.tree.map(np.array, state)


def assert_bitwise_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def setup(opt_name, loss_fn=loss, **kwargs):
    sparse, implementation = OPTIMIZERS[opt_name]
    opt = CombinedOptimizer(optax.adam(0.01), sparse())
    graphdef, state = train.init_train_state(DenseModel(rngs=nnx.Rngs(0)), opt)
    step = train.make_train_step(graphdef, opt, loss_fn, implementation=implementation, **kwargs)
    return graphdef, state, step


def poisoned(kind, rng):
    kjt, x, y = batch(rng)
    if kind == "nan_label":
        return kjt, x, y.at[2].set(jnp.nan)
    return kjt, x.at[1, 0].set(jnp.inf), y  # "inf_dense"


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["nan_label", "inf_dense"])
def test_bad_step_changes_nothing_and_training_goes_on(opt_name, kind):
    rng = np.random.default_rng(0)
    good1, bad, good2 = batch(rng), poisoned(kind, rng), batch(rng)
    _, state, step = setup(opt_name, skip_nonfinite=True)
    state, _, _ = step(state, good1)  # non-zero optimizer state and counts
    before = host(state)
    state, loss_value, _ = step(state, bad)
    assert not np.isfinite(float(loss_value))  # the loss is still reported
    assert_bitwise_equal(host(state), before)  # params, tables, rest, dense and sparse state
    assert step.skipped_steps() == 1
    state, _, _ = step(state, good2)
    assert step.skipped_steps() == 1

    _, ref, ref_step = setup(opt_name, skip_nonfinite=True)  # never sees the bad batch
    for b in (good1, good2):
        ref, _, _ = ref_step(ref, b)
    assert_bitwise_equal(host(state), host(ref))
    assert ref_step.skipped_steps() == 0


def test_pallas_update_is_masked_too():
    """The Pallas fused update (the GPU default; interpreted here) touches no row on a skip."""
    rng = np.random.default_rng(4)
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(DenseModel(rngs=nnx.Rngs(0)), opt)
    step = train.make_train_step(graphdef, opt, loss, implementation="pallas", skip_nonfinite=True)
    good, bad = batch(rng), poisoned("nan_label", rng)
    assert "pallas_call" in str(jax.make_jaxpr(step.jitted)(state, bad))
    state, _, _ = step(state, good)
    before = host(state)
    state, _, _ = step(state, bad)
    assert_bitwise_equal(host(state), before)
    assert step.skipped_steps() == 1


def test_sequence_collection_called_twice_is_masked():
    """EmbeddingCollection (sequence lookups) read twice in one step: both calls masked."""
    rng = np.random.default_rng(5)
    opt = CombinedOptimizer(optax.sgd(0.01), optim.adam(0.05))
    graphdef, state = train.init_train_state(SeqModel(rngs=nnx.Rngs(0)), opt)

    def scaled(model, batch):
        kjt, scale = batch
        return model(kjt) * scale

    step = train.make_train_step(graphdef, opt, scaled, skip_nonfinite=True)
    state, _, _ = step(state, (random_batch(rng)[0], jnp.float32(1.0)))
    before = host(state)
    state, _, _ = step(state, (random_batch(rng)[0], jnp.float32(jnp.inf)))
    assert_bitwise_equal(host(state), before)
    assert step.skipped_steps() == 1


def test_nonfinite_embedding_output_gradient_is_caught():
    """A finite loss with a NaN gradient at the collection output (the dense grads are finite)."""
    rng = np.random.default_rng(1)
    _, state, step = setup("rowwise_adagrad", nan_grad_loss, skip_nonfinite=True)
    before = host(state)
    state, loss_value, _ = step(state, batch(rng))
    assert np.isfinite(float(loss_value))
    assert_bitwise_equal(host(state), before)
    assert step.skipped_steps() == 1


@pytest.mark.parametrize("opt_name", ["rowwise_adagrad", "adam"])
def test_guard_off_keeps_the_old_behaviour(opt_name):
    """Off (the default): the bad step is applied (NaN rows and dense params) and not counted;
    on a finite batch the two settings give the same state."""
    rng = np.random.default_rng(2)
    good, bad = batch(rng), poisoned("nan_label", rng)
    _, off, step_off = setup(opt_name)
    _, on, step_on = setup(opt_name, skip_nonfinite=True)
    off, _, _ = step_off(off, good)
    on, _, _ = step_on(on, good)
    jax.tree.map(np.testing.assert_array_equal, host(off), host(on))
    off, _, _ = step_off(off, bad)
    assert step_off.skipped_steps() == 0
    kernel = np.asarray(off.params["head"]["kernel"].get_value())
    assert np.isnan(kernel).all()
    # Rows of sample 2 (the NaN label) became NaN, the other rows did not.
    table = np.asarray(off.tables["ebc"]["weights"]["fp32_d4"].get_value())
    expected = set()
    for key, offset in (("a", 0), ("b", 0), ("d", 30), ("b", 30)):  # t1 rows 0-29, t3 from 30
        lengths = np.asarray(bad[0][key].lengths())
        start = int(lengths[:2].sum())
        ids = np.asarray(bad[0][key].values())[start : start + lengths[2]]
        expected |= {offset + int(i) for i in ids}
    assert expected
    assert set(np.flatnonzero(np.isnan(table).any(axis=1))) == expected


def test_guarded_step_still_updates_tables_in_place():
    """The guard masks the sparse update; it must not add a table-sized select or copy."""
    table_bytes = 4_000_000 * 128 * 4
    mem = _abstract_step(dense_autodiff=False, skip_nonfinite=True).memory_analysis()
    assert mem.temp_size_in_bytes < table_bytes / 8, mem
    assert mem.alias_size_in_bytes >= table_bytes + 4_000_000 * 4, mem


def test_skipped_step_undoes_row_resets():
    """Rows a managed-collision eviction re-initialised in the forward come back on a skip,
    with their optimizer state; ``rest`` (the reset call counter) is not advanced."""
    rng = np.random.default_rng(3)
    opt = CombinedOptimizer(optax.sgd(0.05), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(ResetModel(rngs=nnx.Rngs(0)), opt)
    step = train.make_train_step(graphdef, opt, reset_loss, skip_nonfinite=True)
    kjt, y = random_batch(rng)
    state, _, _ = step(state, (kjt, y, no_resets()))  # non-zero optimizer state
    resets = {t: jnp.full((K,), FILL, jnp.int32) for t in NAMES}
    resets["t1"] = jnp.asarray([0, 5, 29, FILL], jnp.int32)
    resets["t2"] = jnp.asarray([3, 3, FILL, FILL], jnp.int32)
    before = host(state)
    kjt, y = random_batch(rng)
    state, _, _ = step(state, (kjt, y.at[0].set(jnp.nan), resets))
    assert_bitwise_equal(host(state), before)
    assert step.skipped_steps() == 1
    # The same resets on a finite batch do change those rows (the test above is not vacuous).
    state, _, _ = step(state, (kjt, y, resets))
    after = np.asarray(state.tables["ebc"]["weights"]["fp32_d8"].get_value())
    assert not np.array_equal(after[3], before.tables["ebc"]["weights"]["fp32_d8"][3])
