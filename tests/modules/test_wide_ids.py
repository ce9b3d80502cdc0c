"""Lookups on id words: a wide id is out of range, never a wrapped row.

The reference is the lookup on an int32 KJT built from the same Python bags with
every id outside ``[0, num_embeddings)`` removed (numpy for the sequence rows).
"""

import logging

import jax
import numpy as np
import pytest
from flax import nnx

import jaxrec as jr
from jaxrec.inference import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from jaxrec.modules import FeatureProcessedEmbeddingBagCollection, PositionWeightedModule
from jaxrec.ops import pooled_lookup
from jaxrec.sparse import to_id_words

ROWS, DIM = 6, 4
KEYS = ["f0", "f1"]
WIDE = [2**31, 2**32, 2**32 + 1, 2**40 + 3, 2**63 - 1, -1, -(2**63)]
# f0: [1, wide..] [2]       f1: [3, 2**32 + 4] [ROWS, 5]    (ROWS: narrow, out of range)
BAGS = {"f0": [[1, *WIDE], [2]], "f1": [[3, 2**32 + 4], [ROWS, 5]]}
CAPS = [16, 8]
N_BAD = len(WIDE) + 2


def kjt_of(bags):
    values = np.asarray([i for k in KEYS for bag in bags[k] for i in bag], np.int64)
    lengths = [len(bag) for k in KEYS for bag in bags[k]]
    return jr.KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths, capacities=CAPS)


def dropped(bags):
    return {k: [[i for i in bag if 0 <= i < ROWS] for bag in bs] for k, bs in bags.items()}


def tables(cls, dims=(DIM, DIM)):
    return [
        cls(name=f"t{i}", embedding_dim=d, num_embeddings=ROWS, feature_names=[k])
        for i, (k, d) in enumerate(zip(KEYS, dims, strict=True))
    ]


def test_words_batch_is_wide():
    kjt = kjt_of(BAGS)
    assert kjt.is_wide() and not kjt_of(dropped(BAGS)).is_wide()


@pytest.mark.parametrize("mode", ["IGNORE", "WARNING"])
@pytest.mark.parametrize("impl", ["xla", None])
def test_ebc_drops_wide_ids(mode, impl, caplog):
    ebc = jr.EmbeddingBagCollection(
        tables(jr.EmbeddingBagConfig),
        rngs=nnx.Rngs(0),
        bounds_check_mode=mode,
        implementation=impl,
    )
    want = np.asarray(ebc(kjt_of(dropped(BAGS))).values())
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        got = np.asarray(jax.block_until_ready(ebc(kjt_of(BAGS)).values()))
        jax.effects_barrier()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    sd = ebc.state_dict()
    w0 = np.asarray(sd["embedding_bags.t0.weight"])
    np.testing.assert_allclose(got[0, :DIM], w0[1], rtol=1e-6)  # only id 1 of bag 0
    assert (f"{N_BAD} ids out of range" in caplog.text) == (mode == "WARNING")


@pytest.mark.parametrize("mode", ["IGNORE", "WARNING"])
def test_ec_drops_wide_ids(mode):
    ec = jr.EmbeddingCollection(
        tables(jr.EmbeddingConfig), rngs=nnx.Rngs(0), bounds_check_mode=mode, need_indices=True
    )
    out = ec(kjt_of(BAGS))
    sd = ec.state_dict()
    for i, k in enumerate(KEYS):
        w = np.asarray(sd[f"embeddings.t{i}.weight"])
        ids = [x for bag in BAGS[k] for x in bag]
        want = np.zeros((CAPS[i], DIM), np.float32)
        for p, x in enumerate(ids):
            if 0 <= x < ROWS:
                want[p] = w[x]
        name = ec.embedding_names[i]
        np.testing.assert_allclose(np.asarray(out[name].values()), want, rtol=1e-6)
        narrowed = [x if 0 <= x < 2**31 else -1 for x in ids]  # the ids the lookup read
        assert np.asarray(out[name].weights())[: len(ids)].tolist() == narrowed


def test_fatal_names_the_feature():
    ebc = jr.EmbeddingBagCollection(  # two dims: one lookup (and one check) per feature
        tables(jr.EmbeddingBagConfig, dims=(DIM, 2 * DIM)),
        rngs=nnx.Rngs(0),
        bounds_check_mode="FATAL",
    )
    only_f1 = {"f0": [[1], [2]], "f1": [[3, 2**40], [5]]}
    with pytest.raises(Exception, match=r"1 ids out of range in pooled lookup of \['f1'\]"):
        jax.block_until_ready(ebc(kjt_of(only_f1)).values())
        jax.effects_barrier()
    jax.block_until_ready(ebc(kjt_of(dropped(only_f1))).values())  # no wide id: fine


def test_quantized_collections_drop_wide_ids():
    ebc = jr.EmbeddingBagCollection(
        tables(jr.EmbeddingBagConfig), rngs=nnx.Rngs(0), bounds_check_mode="IGNORE"
    )
    q = QuantEmbeddingBagCollection.from_float(ebc)
    np.testing.assert_array_equal(
        np.asarray(q(kjt_of(BAGS)).values()), np.asarray(q(kjt_of(dropped(BAGS))).values())
    )
    ec = jr.EmbeddingCollection(
        tables(jr.EmbeddingConfig), rngs=nnx.Rngs(0), bounds_check_mode="IGNORE"
    )
    qe = QuantEmbeddingCollection.from_float(ec)
    got, ref = qe(kjt_of(BAGS)), qe(kjt_of(BAGS).narrow_ids())
    for name in got:
        np.testing.assert_array_equal(np.asarray(got[name].values()), ref[name].values())
    assert np.abs(np.asarray(got[qe.embedding_names[0]].values())[1:8]).sum() == 0  # wide rows


def test_feature_processed_ebc_drops_wide_ids():
    ebc = jr.EmbeddingBagCollection(
        tables(jr.EmbeddingBagConfig),
        is_weighted=True,
        rngs=nnx.Rngs(0),
        bounds_check_mode="IGNORE",
    )
    fp = FeatureProcessedEmbeddingBagCollection(
        ebc, {k: PositionWeightedModule(max_feature_length=12) for k in KEYS}
    )
    # position weights are all 1 at init: dropping ids keeps the others' weights
    got = np.asarray(fp(kjt_of(BAGS)).values())
    np.testing.assert_allclose(got, np.asarray(fp(kjt_of(dropped(BAGS))).values()), rtol=1e-6)


def test_single_table_pooled_lookup_takes_words():
    table = np.arange(ROWS * 2, dtype=np.float32).reshape(ROWS, 2)
    ids = np.asarray([1, 2**32 + 1, 3, -1], np.int64)
    lengths = np.asarray([2, 2], np.int32)
    got = pooled_lookup(table, to_id_words(ids), lengths, bounds_check_mode="IGNORE")
    np.testing.assert_allclose(np.asarray(got), table[[1, 3]])
