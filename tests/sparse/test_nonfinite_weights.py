"""Non-finite per-sample weights: rejected by host builders, reported and dropped on device."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxrec as jr
from jaxrec import cpu, optim
from jaxrec.embedding import CombinedOptimizer
from jaxrec.train import init_train_state, make_train_step

IMPLS = ["xla", pytest.param("cpu", marks=pytest.mark.skipif(not cpu.available(), reason="no C++"))]
BAD = [np.nan, np.inf, -np.inf]


@pytest.mark.parametrize("bad", BAD)
def test_host_builders_reject_non_finite_weights(bad):
    w = [1.0, bad, 0.5]
    with pytest.raises(ValueError, match=r"weights must be finite, got weights\[1\]"):
        jr.JaggedTensor(values=[1, 2, 3], lengths=[1, 2], weights=w)
    with pytest.raises(ValueError, match="weights must be finite"):
        jr.JaggedTensor.from_dense([[1], [2, 3]], weights=[[1.0], [bad, 0.5]])
    with pytest.raises(ValueError, match="weights must be finite"):
        jr.KeyedJaggedTensor(["a", "b"], [1, 2, 3], w, lengths=[1, 0, 1, 1])
    with pytest.raises(ValueError, match="weights must be finite"):
        jr.KeyedJaggedTensor.from_lengths_sync(["a", "b"], [1, 2, 3], [1, 0, 1, 1], weights=w)
    with pytest.raises(ValueError, match="weights must be finite"):
        jr.KeyedJaggedTensor.from_offsets_sync(["a", "b"], [1, 2, 3], [0, 1, 1, 2, 3], weights=w)
    with pytest.raises(ValueError, match="weights must be finite"):
        jr.KeyedJaggedTensor.from_lengths_sync(
            ["a", "b"], [1, 2, 3], [1, 0, 1, 1], weights=w, on_host=True
        )
    kjt = jr.KeyedJaggedTensor(
        ["a", "b"],
        jnp.asarray([1, 2, 3]),
        jnp.asarray(w, jnp.float32),
        lengths=jnp.asarray([1, 0, 1, 1]),
        capacities=[1, 2],
    )  # device arrays: unchecked until asked
    with pytest.raises(ValueError, match="weights must be finite"):
        kjt.validate()


TABLES = [
    jr.EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=6, feature_names=["a"]),
    jr.EmbeddingBagConfig(
        name="t1",
        embedding_dim=4,
        num_embeddings=6,
        feature_names=["b"],
        pooling=jr.PoolingType.MEAN,
    ),
]
# a: [1, 2] [3]   b: [4] [5, 0]; the weight of id 2 (key a) and of id 0 (key b) are bad
VALUES = np.asarray([1, 2, 3, 4, 5, 0], np.int32)
LENGTHS = np.asarray([2, 1, 1, 2], np.int32)


def device_kjt(bad):
    w = np.asarray([0.5, bad, 2.0, 1.5, 0.25, bad], np.float32)
    kjt = jr.KeyedJaggedTensor(
        ["a", "b"],
        jnp.asarray(VALUES),
        jnp.asarray(w),
        lengths=jnp.asarray(LENGTHS),
        capacities=[3, 3],
    )
    return kjt, w


def reference(ebc, w):
    sd = ebc.state_dict()
    t0 = np.asarray(sd["embedding_bags.t0.weight"], np.float64)
    t1 = np.asarray(sd["embedding_bags.t1.weight"], np.float64)
    out = np.zeros((2, 8))
    out[0, :4] = t0[1] * w[0]  # id 2's weight is bad: it contributes zero
    out[1, :4] = t0[3] * w[2]
    out[0, 4:] = t1[4] * w[3]
    out[1, 4:] = t1[5] * w[4] / 2  # MEAN still divides by the bag length (2)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", BAD)
def test_device_weights_are_reported_and_dropped(impl, bad, caplog):
    kjt, w = device_kjt(bad)
    ebc = jr.EmbeddingBagCollection(
        TABLES, True, rngs=nnx.Rngs(0), implementation=impl, bounds_check_mode="WARNING"
    )
    want = reference(ebc, w)
    f = jax.jit(lambda m, x: m(x).values())
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        got = jax.block_until_ready(f(ebc, kjt))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert "2 per-sample weights of pooled lookup" in caplog.text
    assert "first in key 'a'" in caplog.text
    caplog.clear()
    ebc.bounds_check_mode = jr.BoundsCheckMode.IGNORE
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        np.testing.assert_allclose(f(ebc, kjt), want, rtol=1e-6, atol=1e-7)
    assert caplog.text == ""
    ebc.bounds_check_mode = jr.BoundsCheckMode.FATAL
    with pytest.raises(Exception, match="are NaN or infinite"):
        jax.block_until_ready(f(ebc, kjt))


def test_padding_weights_are_not_checked(caplog):
    w = np.asarray([0.5, 1.0, np.nan, 2.0, np.nan, np.nan], np.float32)  # NaN only in padding
    kjt = jr.KeyedJaggedTensor(
        ["a", "b"],
        jnp.asarray(VALUES),
        jnp.asarray(w),
        lengths=jnp.asarray([1, 1, 1, 0]),
        capacities=[3, 3],
    )
    ebc = jr.EmbeddingBagCollection(TABLES, True, rngs=nnx.Rngs(0), bounds_check_mode="FATAL")
    got = jax.block_until_ready(ebc(kjt).values())
    assert np.all(np.isfinite(got))


def test_single_table_lookup_drops_and_reports(caplog):
    table = jnp.arange(12.0).reshape(6, 2)
    f = jax.jit(lambda t, v, n, w: jr.ops.pooled_lookup(t, v, n, w, bounds_check_mode="WARNING"))
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        got = f(table, jnp.asarray([1, 2, 3]), jnp.asarray([2, 1]), jnp.asarray([2.0, np.nan, 1]))
        jax.block_until_ready(got)
    np.testing.assert_array_equal(got, [2 * np.asarray(table[1]), np.asarray(table[3])])
    assert "1 per-sample weights of pooled_lookup are NaN or infinite" in caplog.text


class Model(nnx.Module):
    def __init__(self, impl):
        self.ebc = jr.EmbeddingBagCollection(
            TABLES, True, rngs=nnx.Rngs(0), implementation=impl, bounds_check_mode="IGNORE"
        )

    def __call__(self, kjt):
        return self.ebc(kjt).values()


@pytest.mark.parametrize("impl", IMPLS)
def test_train_step_keeps_tables_finite(impl):
    kjt, _ = device_kjt(np.nan)
    model = Model(impl)
    before = np.asarray(model.ebc.weights["fp32_d4"].get_value())
    opt = CombinedOptimizer(optax.sgd(0.1), optim.sgd(0.1))
    graphdef, state = init_train_state(model, opt)
    step = make_train_step(graphdef, opt, lambda m, x: jnp.sum(m(x)), implementation=impl)
    state, loss, _ = step(state, kjt)
    after = np.asarray(state.tables["ebc"]["weights"]["fp32_d4"].get_value())
    assert np.isfinite(float(loss)) and np.all(np.isfinite(after))
    for r in (2, 6 + 0):  # ids whose weight was NaN: never updated
        np.testing.assert_array_equal(after[r], before[r])
    for r in (1, 3, 6 + 4, 6 + 5):
        assert not np.array_equal(after[r], before[r])
