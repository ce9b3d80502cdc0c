import dataclasses
import math

import jax
import pytest

from jaxrec import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from jaxrec.configs import check_tables, get_embedding_names_by_table


def test_defaults_match_torchrec():
    c = EmbeddingBagConfig(name="t", num_embeddings=100, embedding_dim=8)
    assert c.feature_names == ("t",)  # TorchRec defaults feature_names to [name]
    assert c.pooling is PoolingType.SUM and c.data_type is DataType.FP32
    assert c.get_weight_init_max() == pytest.approx(math.sqrt(1 / 100))
    assert c.get_weight_init_min() == pytest.approx(-math.sqrt(1 / 100))
    assert c.num_features() == 1
    e = EmbeddingConfig(name="s", num_embeddings=10, embedding_dim=4, feature_names=["a", "b"])
    assert e.feature_names == ("a", "b") and e.dtype == jax.numpy.float32


def test_frozen_and_replace():
    feats = ["f"]
    c = EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=feats)
    feats.append("g")  # the caller's list is not aliased
    assert c.feature_names == ("f",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_embeddings = 5
    assert dataclasses.replace(c, num_embeddings=5).num_embeddings == 5


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_embeddings": 0}, ValueError, "num_embeddings must be a positive int"),
        ({"embedding_dim": -1}, ValueError, "embedding_dim must be a positive int"),
        ({"embedding_dim": 4.0}, ValueError, "embedding_dim must be a positive int"),
        ({"name": ""}, ValueError, "needs a name"),
        ({"feature_names": "f"}, TypeError, "wrap it in a list"),
        ({"feature_names": ["f", "f"]}, ValueError, "more than once"),
        ({"data_type": "FP32"}, TypeError, "DataType"),
        ({"weight_init_min": 1.0, "weight_init_max": 0.0}, ValueError, "weight_init_min"),
        ({"pooling": PoolingType.NONE}, ValueError, "use EmbeddingConfig"),
    ],
)
def test_bad_configs(kwargs, error, match):
    base = {"name": "t", "num_embeddings": 10, "embedding_dim": 4}
    with pytest.raises(error, match=match):
        EmbeddingBagConfig(**{**base, **kwargs})


def test_table_list_checks():
    a = EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4)
    with pytest.raises(ValueError, match="duplicate table names"):
        check_tables([a, a], EmbeddingBagConfig)
    with pytest.raises(TypeError, match="expected EmbeddingConfig"):
        check_tables([a], EmbeddingConfig)
    with pytest.raises(ValueError, match="at least one"):
        check_tables([], EmbeddingBagConfig)


def test_shared_feature_names_follow_torchrec():
    t1 = EmbeddingBagConfig(name="t1", num_embeddings=10, embedding_dim=4, feature_names=["a", "b"])
    t2 = EmbeddingBagConfig(name="t2", num_embeddings=10, embedding_dim=4, feature_names=["b"])
    assert get_embedding_names_by_table([t1, t2]) == [["a", "b@t1"], ["b@t2"]]
