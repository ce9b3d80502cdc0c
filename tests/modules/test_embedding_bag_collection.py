import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from numpy_reference import packed, pooled, random_bags

from jaxrec import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingTable,
    KeyedJaggedTensor,
    PoolingType,
)


def tutorial_ebc(rngs=None):
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name="product_table",
                embedding_dim=64,
                num_embeddings=4096,
                feature_names=["product"],
                pooling=PoolingType.SUM,
            ),
            EmbeddingBagConfig(
                name="user_table",
                embedding_dim=64,
                num_embeddings=4096,
                feature_names=["user"],
                pooling=PoolingType.SUM,
            ),
        ],
        rngs=rngs or nnx.Rngs(0),
    )


def test_tutorial_shapes():
    ebc = tutorial_ebc()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["product", "user"], [1, 2, 3, 1, 5, 7, 9, 2, 3, 4, 1], [3, 4, 2, 2]
    )
    result = ebc(kjt)
    assert result.keys() == ["product", "user"]
    assert result.values().shape == (2, 128)
    assert {k: v.shape for k, v in result.to_dict().items()} == {
        "product": (2, 64),
        "user": (2, 64),
    }
    sd = ebc.state_dict()
    assert {k: v.shape for k, v in sd.items()} == {
        "embedding_bags.product_table.weight": (4096, 64),
        "embedding_bags.user_table.weight": (4096, 64),
    }
    bound = np.sqrt(1 / 4096)  # TorchRec's default init: U(-sqrt(1/n), sqrt(1/n))
    w = np.asarray(sd["embedding_bags.user_table.weight"])
    assert -bound <= w.min() < -0.9 * bound and 0.9 * bound < w.max() <= bound
    assert not np.array_equal(w, sd["embedding_bags.product_table.weight"])


def mixed_tables():
    """Mixed dims and dtypes, a shared table (two features) and a feature in two tables."""
    return [
        EmbeddingBagConfig(
            name="t_a", embedding_dim=4, num_embeddings=30, feature_names=["f1", "f2"]
        ),
        EmbeddingBagConfig(
            name="t_b",
            embedding_dim=8,
            num_embeddings=20,
            feature_names=["f3"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(
            name="t_c",
            embedding_dim=4,
            num_embeddings=25,
            feature_names=["f2"],
            data_type=DataType.FP16,
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(
            name="t_d",
            embedding_dim=4,
            num_embeddings=10,
            feature_names=["f4"],
            weight_init_min=0.5,
            weight_init_max=0.5,
        ),
    ]


@pytest.mark.parametrize("weighted", [False, True])
def test_mixed_collection_against_numpy(weighted):
    rng = np.random.default_rng(0)
    tables = mixed_tables()
    ebc = EmbeddingBagCollection(tables, is_weighted=weighted, rngs=nnx.Rngs(1))
    keys = ["f4", "f3", "f2", "f1", "unused"]  # any key order; extra keys are ignored
    rows = {"f1": 30, "f2": 25, "f3": 20, "f4": 10, "unused": 5}
    bags = [random_bags(rng, 6, 5, rows[k]) for k in keys]
    values, lengths = packed(bags)
    w = rng.uniform(0.5, 2.0, len(values)).astype(np.float32) if weighted else None
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=w)
    out = nnx.jit(lambda m, k: m(k))(ebc, kjt)
    assert out.keys() == ["f1", "f2@t_a", "f3", "f2@t_c", "f4"]
    assert out.length_per_key() == [4, 4, 8, 4, 4]
    sd = {k: np.asarray(v.astype(jnp.float32)) for k, v in ebc.state_dict().items()}
    np.testing.assert_array_equal(sd["embedding_bags.t_d.weight"], 0.5)
    off = np.concatenate([[0], np.cumsum(lengths)])
    bag_w = (
        [[w[off[k * 6 + b] : off[k * 6 + b + 1]] for b in range(6)] for k in range(5)]
        if weighted
        else None
    )
    expect = {
        "f1": ("t_a", "f1", "SUM"),
        "f2@t_a": ("t_a", "f2", "SUM"),
        "f3": ("t_b", "f3", "MEAN"),
        "f2@t_c": ("t_c", "f2", "MEAN"),
        "f4": ("t_d", "f4", "SUM"),
    }
    for name, (table, key, pool) in expect.items():
        k = keys.index(key)
        ref = pooled(
            sd[f"embedding_bags.{table}.weight"], bags[k], pool, None if bag_w is None else bag_w[k]
        )
        np.testing.assert_allclose(out[name], ref, rtol=2e-3 if table == "t_c" else 1e-5, atol=1e-5)
    assert ebc.weights["fp16_d4"].get_value().dtype == jnp.float16
    assert out.values().dtype == jnp.float32  # fp16 tables accumulate in fp32


def test_tables_are_not_params_and_state_dict_roundtrip():
    ebc = EmbeddingBagCollection(mixed_tables(), rngs=nnx.Rngs(0))
    assert nnx.state(ebc, nnx.Param) == nnx.State({})
    tables = jax.tree.leaves(nnx.state(ebc, EmbeddingTable))
    assert sorted(t.shape for t in tables) == [(20, 8), (25, 4), (40, 4)]  # t_a + t_d stacked
    rng = np.random.default_rng(0)
    new = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in ebc.state_dict().items()}
    ebc.load_state_dict(new)
    for k, v in ebc.state_dict().items():
        tol = 1e-3 if k == "embedding_bags.t_c.weight" else 0
        np.testing.assert_allclose(np.asarray(v, np.float32), new[k], atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="missing keys \\['embedding_bags.t_d.weight'\\]"):
        ebc.load_state_dict({k: v for k, v in new.items() if "t_d" not in k})
    with pytest.raises(ValueError, match="expected shape \\(10, 4\\)"):
        ebc.load_state_dict({**new, "embedding_bags.t_d.weight": np.zeros((4, 10))})
    ebc.load_state_dict({"embedding_bags.t_d.weight": np.ones((10, 4))}, strict=False)
    assert float(ebc.state_dict()["embedding_bags.t_d.weight"].sum()) == 40


def test_init_fn_and_reset_parameters():
    def ones(key, shape, dtype):
        del key
        return jnp.ones(shape, dtype)

    cfg = EmbeddingBagConfig(name="t", embedding_dim=3, num_embeddings=5, init_fn=ones)
    ebc = EmbeddingBagCollection([cfg], rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(ebc.state_dict()["embedding_bags.t.weight"], 1.0)
    rnd = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=3, num_embeddings=5)], rngs=nnx.Rngs(0)
    )
    before = np.asarray(rnd.state_dict()["embedding_bags.t.weight"])
    rnd.reset_parameters(nnx.Rngs(7))
    assert not np.array_equal(before, rnd.state_dict()["embedding_bags.t.weight"])


def test_empty_feature_and_all_ids_in_one_bag():
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=4, feature_names=["a", "b"])],
        rngs=nnx.Rngs(0),
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], [0, 1, 2, 3, 3], [0, 5, 0, 0])
    out = ebc(kjt)
    table = np.asarray(ebc.state_dict()["embedding_bags.t.weight"])
    np.testing.assert_allclose(out["a"][1], table[[0, 1, 2, 3, 3]].sum(0), rtol=1e-6)
    assert not np.any(np.asarray(out["a"][0])) and not np.any(np.asarray(out["b"]))


def test_bad_inputs():
    ebc = EmbeddingBagCollection(mixed_tables(), is_weighted=True, rngs=nnx.Rngs(0))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["f1", "f2", "f3", "f4"], [1], [1, 0, 0, 0, 0, 0, 0, 0]
    )
    with pytest.raises(ValueError, match="carry no weights"):
        ebc(kjt)
    with pytest.raises(ValueError, match="lack keys \\['f4'\\]"):
        EmbeddingBagCollection(mixed_tables(), rngs=nnx.Rngs(0))(kjt.split([3, 1])[0])
    with pytest.raises(TypeError, match="must be a KeyedJaggedTensor"):
        ebc({"f1": kjt})
