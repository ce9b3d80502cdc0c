import numpy as np
import pytest
from flax import nnx
from numpy_reference import packed, random_bags

from jaxrec import EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor


def test_torchrec_doc_example_shapes():
    ec = EmbeddingCollection(
        tables=[
            EmbeddingConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"]),
            EmbeddingConfig(name="t2", embedding_dim=3, num_embeddings=10, feature_names=["f2"]),
        ],
        rngs=nnx.Rngs(0),
    )
    kjt = KeyedJaggedTensor.from_offsets_sync(["f1", "f2"], list(range(8)), [0, 2, 2, 3, 4, 5, 8])
    out = ec(kjt)
    assert list(out) == ["f1", "f2"]
    f2 = out["f2"]
    assert f2.lengths().tolist() == [1, 1, 3]
    table = np.asarray(ec.state_dict()["embeddings.t2.weight"])
    np.testing.assert_allclose(f2.values()[:5], table[[3, 4, 5, 6, 7]])
    assert ec.embedding_dim() == 3 and ec.embedding_names_by_table() == [["f1"], ["f2"]]
    assert not ec.need_indices() and f2.weights_or_none() is None


def test_need_indices_shared_tables_mixed_dims_against_numpy():
    rng = np.random.default_rng(0)
    tables = [
        EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=15, feature_names=["x", "y"]),
        EmbeddingConfig(name="b", embedding_dim=6, num_embeddings=9, feature_names=["y"]),
    ]
    ec = EmbeddingCollection(tables, need_indices=True, rngs=nnx.Rngs(3))
    bags = [random_bags(rng, 4, 3, 9) for _ in range(2)]
    values, lengths = packed(bags)
    kjt = KeyedJaggedTensor.from_lengths_sync(["x", "y"], values, lengths)
    out = nnx.jit(lambda m, k: m(k))(ec, kjt)
    assert list(out) == ["x", "y@a", "y@b"]
    sd = {k: np.asarray(v) for k, v in ec.state_dict().items()}
    for name, table, key in [("x", "a", 0), ("y@a", "a", 1), ("y@b", "b", 1)]:
        ids = [i for b in bags[key] for i in b]
        jt = out[name]
        np.testing.assert_allclose(jt.values()[: len(ids)], sd[f"embeddings.{table}.weight"][ids])
        assert not np.any(np.asarray(jt.values()[len(ids) :]))  # padding rows are zero
        assert jt.weights()[: len(ids)].tolist() == ids  # TorchRec returns ids as weights
    with pytest.raises(ValueError, match="several embedding dims"):
        ec.embedding_dim()


def test_wrong_config_type():
    with pytest.raises(TypeError, match="expected EmbeddingConfig"):
        EmbeddingCollection(
            [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=3)], rngs=nnx.Rngs(0)
        )
