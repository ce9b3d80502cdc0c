"""Same weights, same inputs, same outputs as TorchRec on CPU (skipped without torch)."""

import numpy as np
import pytest
from flax import nnx
from numpy_reference import packed, random_bags

import jaxrec as jr

torch = pytest.importorskip("torch")
torchrec = pytest.importorskip("torchrec")


def to_torch_kjt(keys, values, lengths, weights=None):
    return torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.as_tensor(values, dtype=torch.int64),
        lengths=torch.as_tensor(lengths, dtype=torch.int32),
        weights=None if weights is None else torch.as_tensor(weights),
    )


def torch_configs(tables, cls):
    out = []
    for t in tables:
        kw = dict(
            name=t.name,
            embedding_dim=t.embedding_dim,
            num_embeddings=t.num_embeddings,
            feature_names=list(t.feature_names),
        )
        if hasattr(t, "pooling"):
            kw["pooling"] = getattr(torchrec.PoolingType, t.pooling.value)
        out.append(cls(**kw))
    return out


def batch(rng, keys, rows, b=8):
    bags = [random_bags(rng, b, 6, rows[k]) for k in keys]
    return packed(bags)


@pytest.mark.parametrize("weighted", [False, True])
def test_ebc_matches_torchrec(weighted):
    pooling = jr.PoolingType.SUM if weighted else jr.PoolingType.MEAN  # torch: weights need SUM
    tables = [
        jr.EmbeddingBagConfig(
            name="t1", embedding_dim=8, num_embeddings=40, feature_names=["f1", "f2"]
        ),
        jr.EmbeddingBagConfig(
            name="t2",
            embedding_dim=4,
            num_embeddings=30,
            feature_names=["f2", "f3"],
            pooling=pooling,
        ),
    ]
    ebc = jr.EmbeddingBagCollection(tables, is_weighted=weighted, rngs=nnx.Rngs(0))
    tebc = torchrec.EmbeddingBagCollection(
        tables=torch_configs(tables, torchrec.EmbeddingBagConfig), is_weighted=weighted
    )
    tebc.load_state_dict({k: torch.tensor(np.asarray(v)) for k, v in ebc.state_dict().items()})
    assert list(tebc.state_dict()) == list(ebc.state_dict())
    rng = np.random.default_rng(0)
    keys = ["f1", "f2", "f3"]
    values, lengths = batch(rng, keys, {"f1": 40, "f2": 30, "f3": 30})
    w = rng.uniform(0.5, 2, len(values)).astype(np.float32) if weighted else None
    ours = ebc(jr.KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=w))
    theirs = tebc(to_torch_kjt(keys, values, lengths, w))
    assert ours.keys() == theirs.keys()  # ["f1", "f2@t1", "f2@t2", "f3"]
    assert ours.length_per_key() == theirs.length_per_key()
    assert ours.offset_per_key() == theirs.offset_per_key()
    np.testing.assert_allclose(
        ours.values(), theirs.values().detach().numpy(), rtol=1e-5, atol=1e-6
    )


def test_ec_matches_torchrec():
    tables = [
        jr.EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=20, feature_names=["x", "y"]),
        jr.EmbeddingConfig(name="b", embedding_dim=4, num_embeddings=10, feature_names=["z"]),
    ]
    ec = jr.EmbeddingCollection(tables, need_indices=True, rngs=nnx.Rngs(1))
    tec = torchrec.EmbeddingCollection(
        tables=torch_configs(tables, torchrec.EmbeddingConfig), need_indices=True
    )
    tec.load_state_dict({k: torch.tensor(np.asarray(v)) for k, v in ec.state_dict().items()})
    rng = np.random.default_rng(1)
    keys = ["x", "y", "z"]
    values, lengths = batch(rng, keys, {"x": 20, "y": 20, "z": 10})
    ours = ec(jr.KeyedJaggedTensor.from_lengths_sync(keys, values, lengths))
    theirs = tec(to_torch_kjt(keys, values, lengths))
    assert list(ours) == list(theirs)
    for k in theirs:
        n = int(theirs[k].lengths().sum())
        np.testing.assert_array_equal(ours[k].lengths(), theirs[k].lengths().numpy())
        np.testing.assert_allclose(ours[k].values()[:n], theirs[k].values().detach().numpy())
        np.testing.assert_array_equal(ours[k].weights()[:n], theirs[k].weights().numpy())


def test_kjt_and_keyed_tensor_match_torchrec():
    rng = np.random.default_rng(2)
    keys = ["a", "b", "c"]
    values, lengths = batch(rng, keys, {"a": 9, "b": 9, "c": 9}, b=5)
    ours = jr.KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
    theirs = to_torch_kjt(keys, values, lengths)
    assert ours.keys() == theirs.keys() and ours.stride() == theirs.stride()
    np.testing.assert_array_equal(ours.offsets(), theirs.offsets().numpy())
    assert ours.length_per_key().tolist() == theirs.length_per_key()
    assert ours.offset_per_key().tolist() == theirs.offset_per_key()
    assert str(ours) == str(theirs)
    assert str(ours.permute([2, 0, 1])) == str(theirs.permute([2, 0, 1]))
    with pytest.raises(ValueError, match="repeats keys"):
        ours.permute([1, 1])  # TorchRec allows it; a KJT with duplicate keys has no to_dict
    for k in keys:
        assert [x.tolist() for x in ours[k].to_dense()] == [
            x.tolist() for x in theirs[k].to_dense()
        ]
    x, y = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=(3, 2)).astype(np.float32)
    kt_ours = [jr.KeyedTensor(["p", "q"], [2, 3], x), jr.KeyedTensor(["r"], [2], y)]
    kt_theirs = [
        torchrec.KeyedTensor(["p", "q"], [2, 3], torch.from_numpy(x)),
        torchrec.KeyedTensor(["r"], [2], torch.from_numpy(y)),
    ]
    groups = [["q", "r"], ["p"]]
    for a, b in zip(
        jr.KeyedTensor.regroup(kt_ours, groups),
        torchrec.KeyedTensor.regroup(kt_theirs, groups),
        strict=True,
    ):
        np.testing.assert_allclose(a, b.numpy())


def test_load_torchrec_state_dict_into_jaxrec():
    tables = [
        jr.EmbeddingBagConfig(
            name="t",
            embedding_dim=6,
            num_embeddings=12,
            feature_names=["f"],
            pooling=jr.PoolingType.MEAN,
        )
    ]
    tebc = torchrec.EmbeddingBagCollection(
        tables=torch_configs(tables, torchrec.EmbeddingBagConfig)
    )
    ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(5))
    ebc.load_state_dict({k: v.detach() for k, v in tebc.state_dict().items()})  # torch tensors
    rng = np.random.default_rng(3)
    values, lengths = batch(rng, ["f"], {"f": 12})
    ours = ebc(jr.KeyedJaggedTensor.from_lengths_sync(["f"], values, lengths))
    theirs = tebc(to_torch_kjt(["f"], values, lengths))
    np.testing.assert_allclose(
        ours.values(), theirs.values().detach().numpy(), rtol=1e-5, atol=1e-6
    )
