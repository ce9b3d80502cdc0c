"""Quantized collections and quantize_inference_model: outputs within the error bounds."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from quant_cases import assert_within, bags, ebc_bounds, jit_call, kjt, tables, weights_for

import jaxrec as jr
from jaxrec import models
from jaxrec.inference import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    quantize_inference_model,
)


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16", "bf16", "fp32"])
def test_ebc_within_bound(dtype):
    ebc = jr.EmbeddingBagCollection(tables(), is_weighted=True, rngs=nnx.Rngs(0))
    b, w = bags(), weights_for(bags())
    q = QuantEmbeddingBagCollection.from_float(ebc, dtype)
    features = kjt(b, w)
    want, got = jit_call(ebc, features), jit_call(q, features)
    assert got.keys() == want.keys() and got.length_per_key() == want.length_per_key()
    assert_within(got.values(), want.values(), ebc_bounds(ebc, dtype, b, w))
    if dtype == "fp32":
        np.testing.assert_allclose(got.values(), want.values(), rtol=1e-6, atol=1e-7)


def test_per_table_dtype_and_state_dict():
    ebc = jr.EmbeddingBagCollection(tables(), rngs=nnx.Rngs(1))
    q = QuantEmbeddingBagCollection.from_float(ebc, "int8", per_table_dtype={"t2": "int4"})
    assert q.data_types == {"t1": "int8", "t2": "int4"}
    sd = q.state_dict()
    assert sd["embedding_bags.t1.weight"].shape == (30, 16)  # 4 + 10 -> 16
    assert sd["embedding_bags.t2.weight"].shape == (40, 16)  # 4 + 8 -> 16
    assert q.table_bytes() == 30 * 16 + 40 * 16
    b = bags(2)
    got = jit_call(q, kjt(b)).values()
    t1 = ebc_bounds(ebc, "int8", b)[:, :10]
    t2 = ebc_bounds(ebc, "int4", b)[:, 10:]
    assert_within(got, jit_call(ebc, kjt(b)).values(), np.concatenate([t1, t2], axis=1))
    with pytest.raises(ValueError, match="not in the collection"):
        QuantEmbeddingBagCollection.from_float(ebc, "int8", per_table_dtype={"nope": "int4"})


def test_no_dequantized_table_in_compiled_lookup():
    """The lookup gathers packed rows and dequantizes only those: no [E, D] float array."""
    cfg = [
        jr.EmbeddingBagConfig(
            name="t", embedding_dim=16, num_embeddings=1000, feature_names=["f1", "f2", "f3"]
        )
    ]
    ebc = jr.EmbeddingBagCollection(cfg, rngs=nnx.Rngs(0))
    q = QuantEmbeddingBagCollection.from_float(ebc, "int8")
    graphdef, state = nnx.split(q)
    fn = jax.jit(lambda s, f: nnx.merge(graphdef, s)(f).values())
    features = kjt(bags())
    jaxpr = str(jax.make_jaxpr(fn)(state, features))
    hlo = fn.lower(state, features).compile().as_text()
    for text in (jaxpr, hlo):
        assert re.search(r"u8\[1000,\s?32\]", text)  # the packed table is there
        assert not re.search(r"f(32|16)\[1000,\s?16\]", text)  # its float twin is not
        assert not re.search(r"bf16\[1000,\s?16\]", text)


def test_ec_within_bound():
    cfg = [
        jr.EmbeddingConfig(
            name="t", embedding_dim=10, num_embeddings=40, feature_names=["f2", "f3"]
        )
    ]
    ec = jr.EmbeddingCollection(cfg, need_indices=True, rngs=nnx.Rngs(3))
    q = QuantEmbeddingCollection.from_float(ec, "int4")
    features = kjt(bags())
    want, got = jit_call(ec, features), jit_call(q, features)
    assert set(got) == set(want)
    table = np.asarray(ec.state_dict()["embeddings.t.weight"])
    span = (table.max(1) - table.min(1)) / 15 * 0.51 + 1e-3  # ~ scale / 2 per row
    for k in got:
        ids = np.asarray(want[k].weights())
        valid = np.arange(ids.shape[0]) < int(want[k].lengths().sum())
        err = np.abs(np.asarray(got[k].values()) - np.asarray(want[k].values()))
        assert np.all(err[valid] <= span[ids[valid]][:, None])
        assert not err[~valid].any()
        np.testing.assert_array_equal(got[k].weights(), want[k].weights())


def _dlrm():
    ebc = jr.EmbeddingBagCollection(
        tables()[:1]
        + [
            jr.EmbeddingBagConfig(
                name="t2",
                embedding_dim=10,
                num_embeddings=40,
                feature_names=["f2", "f3"],
                pooling=jr.PoolingType.MEAN,
            )
        ],
        rngs=nnx.Rngs(0),
    )
    return models.DLRM(ebc, 3, [8, 10], [6, 1], rngs=nnx.Rngs(1))


def test_quantize_inference_model_dlrm():
    model = _dlrm()
    dense = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), jnp.float32)
    b = bags()
    features = kjt(b)
    want = jit_call(model, dense, features)
    q8 = quantize_inference_model(model, dtype="int8", per_table_dtype={"t2": "fp16"})
    assert type(model.sparse_arch.embedding_bag_collection) is jr.EmbeddingBagCollection
    qebc = q8.sparse_arch.embedding_bag_collection
    assert isinstance(qebc, QuantEmbeddingBagCollection)
    assert qebc.data_types == {"t1": "int8", "t2": "fp16"}
    ebc = model.sparse_arch.embedding_bag_collection
    bound = np.concatenate(
        [ebc_bounds(ebc, "int8", b)[:, :10], ebc_bounds(ebc, "fp16", b)[:, 10:]], axis=1
    )
    assert_within(jit_call(qebc, features).values(), jit_call(ebc, features).values(), bound)
    got = jit_call(q8, dense, features)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=5e-3)  # through the MLPs: loose
    with pytest.raises(ValueError, match="found in no embedding collection"):
        quantize_inference_model(model, per_table_dtype={"nope": "int4"})
    with pytest.raises(TypeError, match="unsupported quantized table dtype"):
        quantize_inference_model(model, dtype="int3")


def test_bad_quantized_buffers():
    with pytest.raises(ValueError, match=r"expected \[30, 16\] uint8"):
        QuantEmbeddingBagCollection(
            tables()[:1], {"t1": jnp.zeros((30, 14), jnp.uint8)}, {"t1": "int8"}
        )
    q = QuantEmbeddingBagCollection(
        tables()[:1], {"t1": jnp.zeros((30, 16), jnp.uint8)}, {"t1": "int8"}
    )
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        q(jnp.zeros(3))
