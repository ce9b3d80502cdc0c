"""Export of models with managed collision: the id index travels in the artifact.

A dynamic table (``HashZchManagedCollisionModule``, 64-bit ids as id words) and an
MCH table (int32 ids) are trained by a few eager training calls (which admit ids
into the index), exported, loaded, and their predictions on raw ids compared with
the model's own eval forward: admitted ids read their rows, unseen ids read zeros
(dynamic) or the miss row (MCH).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxrec as jr
from jaxrec.inference import InputError, export, load
from jaxrec.inference.request import RequestError, batch_arrays, decode_request
from jaxrec.modules import (
    HashZchManagedCollisionModule,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
)
from jaxrec.sparse.ids64 import to_id_words

KEYS, DIM, SLOTS, NUM_DENSE, MAX_IDS = ("user", "item"), 4, 32, 3, 3
BIG = 2**40  # every dynamic-table id needs more than 32 bits


class Model(nnx.Module):
    def __init__(self, make_mc, *, rngs):
        cfgs = [
            jr.EmbeddingBagConfig(
                name=f"t_{k}", embedding_dim=DIM, num_embeddings=SLOTS, feature_names=[k]
            )
            for k in KEYS
        ]
        ebc = jr.EmbeddingBagCollection(
            cfgs, rngs=rngs, bounds_check_mode=jr.BoundsCheckMode.IGNORE
        )
        mcs = {c.name: make_mc(i) for i, c in enumerate(cfgs)}
        self.sparse = ManagedCollisionEmbeddingBagCollection(
            ebc, ManagedCollisionCollection(mcs, cfgs), rngs=rngs
        )
        self.top = nnx.Linear(NUM_DENSE + len(KEYS) * DIM, 1, rngs=rngs)

    def __call__(self, dense, kjt):
        pooled, _ = self.sparse(kjt)
        return self.top(jnp.concatenate([dense, pooled.values()], axis=1))


def hash_zch(i):
    return HashZchManagedCollisionModule(SLOTS, ways=8, input_hash_seed=i)


def mch(i):
    return MCHManagedCollisionModule(
        SLOTS, eviction_policy=LRU_EvictionPolicy(), eviction_interval=1
    )


def make_kjt(raw: dict, wide: bool) -> jr.KeyedJaggedTensor:
    """Per-feature bags -> a KJT with MAX_IDS capacity per sample and feature."""
    b = len(raw[KEYS[0]])
    flat = [v for k in KEYS for bag in raw[k] for v in bag]
    lengths = [len(bag) for k in KEYS for bag in raw[k]]
    values = to_id_words(np.array(flat, np.int64)) if wide else np.array(flat, np.int32)
    cap = b * MAX_IDS
    pad = np.zeros((len(KEYS) * cap - len(flat), *values.shape[1:]), values.dtype)
    caps = [cap] * len(KEYS)
    # ids of each key packed at the front of its capacity slice
    pieces, at = [], 0
    for k in KEYS:
        n = sum(len(bag) for bag in raw[k])
        pieces += [values[at : at + n], pad[: cap - n]]
        at += n
    return jr.KeyedJaggedTensor.from_parts(
        list(KEYS),
        jnp.asarray(np.concatenate(pieces)),
        jnp.asarray(lengths, jnp.int32),
        capacities=caps,
        stride=b,
    )


def train_stream(rng, steps, b, wide):
    """Raw-id batches for eager training calls: a small pool, so ids repeat."""
    base, hi = (BIG, BIG + 40) if wide else (1000, 1040)
    pool = rng.choice(np.arange(base, hi), 20, replace=False).tolist()
    for _ in range(steps):
        raw = {
            k: [rng.choice(pool, rng.integers(1, MAX_IDS + 1)).tolist() for _ in range(b)]
            for k in KEYS
        }
        yield np.ones((b, NUM_DENSE), np.float32), raw


@nnx.jit
def forward(model, dense, kjt):
    return model(dense, kjt)


def trained(make_mc, wide, b=4):
    model = Model(make_mc, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    pool = []
    for dense, raw in train_stream(rng, 4, b, wide):
        kjt = make_kjt(raw, wide)
        model.sparse.ensure_buffers(kjt)
        forward(model, jnp.asarray(dense), kjt)  # a training call: admits ids into the index
        pool += [v for k in KEYS for bag in raw[k] for v in bag]
    return model, sorted(set(pool)), make_kjt(raw, wide)


def eval_forward(model, dense, raw, wide):
    m = nnx.clone(model)
    m.eval()
    return np.asarray(forward(m, jnp.asarray(dense), make_kjt(raw, wide)))


def query(rng, pool, unseen, b):
    """b samples mixing admitted ids, unseen ids and empty bags."""
    raw = {k: [] for k in KEYS}
    for i in range(b):
        for k in KEYS:
            n = int(rng.integers(0, MAX_IDS + 1))
            ids = rng.choice(pool, n).tolist()
            if i % 3 == 1 and n:
                ids[0] = unseen[i % len(unseen)]
            raw[k].append([int(v) for v in ids])
    return raw


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory):
    model, pool, example = trained(hash_zch, wide=True)
    path = tmp_path_factory.mktemp("dynamic") / "artifact"
    manifest = export(model, (jnp.ones((4, NUM_DENSE)), example), path)
    return model, pool, manifest, load(path)


def test_dynamic_manifest(dynamic):
    model, _, m, loaded = dynamic
    mcs = model.sparse.managed_collision_collection.managed_collision_modules
    assert all(int(mc.counters()["occupancy"]) > 0 for mc in mcs.values())  # ids admitted
    assert m["ids_dtype"] == "uint32x2"
    assert m["raw_id_features"] == list(KEYS)
    keys = [w for w in m["weights"] if "key_impl" in w]
    assert keys and all(w["dtype"] == "uint32" for w in keys), keys
    assert all("reset_rngs" in w["path"] for w in keys)
    assert loaded.exported.in_avals[len(m["weights"]) + 1].shape[1:] == (2 * MAX_IDS, 2)


def test_dynamic_predicts_like_eval_forward(dynamic):
    model, pool, _, loaded = dynamic
    rng = np.random.default_rng(1)
    unseen = [BIG + 10**6, 2**62 + 3, -(2**50)]
    raw = query(rng, pool, unseen, 6)
    dense = rng.normal(size=(6, NUM_DENSE)).astype(np.float32)
    want = eval_forward(model, dense, raw, wide=True)
    np.testing.assert_allclose(loaded(dense, raw), want, rtol=1e-5, atol=1e-6)
    # the same ids as numpy int64 / uint64 arrays, and as a KJT of id words
    as_np = {k: [np.array(bag, np.int64) for bag in raw[k]] for k in KEYS}
    np.testing.assert_allclose(loaded(dense, as_np), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loaded(dense, make_kjt(raw, wide=True)), want, rtol=1e-5, atol=1e-6)


def test_dynamic_unseen_ids_read_zeros(dynamic):
    model, pool, _, loaded = dynamic
    dense = np.ones((3, NUM_DENSE), np.float32)
    unseen = {
        "user": [[BIG + 777], [], [2**64 - 5, BIG + 999]],
        "item": [[], [np.uint64(2**63 + 1)], [BIG - 1]],
    }
    empty = {k: [[], [], []] for k in KEYS}
    got = loaded(dense, unseen)
    np.testing.assert_allclose(got, loaded(dense, empty), rtol=1e-6, atol=1e-6)
    # an admitted id does not read zeros
    seen = {k: [[pool[0]], [], []] for k in KEYS}
    assert not np.allclose(loaded(dense, seen)[0], got[0])


def test_dynamic_json_request(dynamic):
    model, pool, _, loaded = dynamic
    inst = [
        {"dense": [0.5, -1.0, 2.0], "sparse": {"user": [pool[3], BIG + 5], "item": [pool[1]]}},
        {"dense": [0.0, 0.0, 1.0], "sparse": {"user": [], "item": [2**64 - 1, pool[2]]}},
    ]
    batch = decode_request(loaded, json.dumps({"instances": inst}))
    got = loaded.run(*batch_arrays(loaded, batch))
    raw = {k: [i["sparse"][k] for i in inst] for k in KEYS}
    dense = np.array([i["dense"] for i in inst], np.float32)
    np.testing.assert_allclose(got, loaded(dense, raw), rtol=1e-6, atol=1e-6)
    raw64 = {k: [[v if v < 2**63 else v - 2**64 for v in bag] for bag in raw[k]] for k in KEYS}
    np.testing.assert_allclose(got, eval_forward(model, dense, raw64, True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "ids, match",
    [
        ([[1.5], []], r"feature 'user' sample 0: ids must be a flat list of integers, got dtype"),
        ([["7"], []], r"feature 'user' sample 0: ids must be a flat list of integers, got str"),
        ([[True], []], r"feature 'user' sample 0: ids must be integers, got a bool"),
        ([[2**64], []], r"feature 'user' sample 0: id 18446744073709551616 does not fit 64 bits"),
        ([[-(2**63) - 1], []], r"does not fit 64 bits"),
        ([np.array([1.0]), []], r"ids must be a flat list of integers, got dtype float64"),
    ],
)
def test_dynamic_bad_ids(dynamic, ids, match):
    loaded = dynamic[3]
    with pytest.raises(InputError, match=match):
        loaded(np.ones((2, NUM_DENSE), np.float32), {"user": ids, "item": [[], []]})


@pytest.mark.parametrize(
    "ids, match",
    [
        ("[1.5]", r"instance 0: feature 'user': ids must be integers, got a number 1.5"),
        ('["12"]', r"ids must be integers, got a string"),
        (str(2**64), r"id 18446744073709551616 does not fit 64 bits"),
    ],
)
def test_dynamic_bad_request(dynamic, ids, match):
    loaded = dynamic[3]
    ids = ids if ids.startswith("[") else f"[{ids}]"
    body = f'{{"instances": [{{"dense": [1, 2, 3], "sparse": {{"user": {ids}, "item": []}}}}]}}'
    with pytest.raises(RequestError, match=match):
        decode_request(loaded, body)


def test_mch_int32_ids(tmp_path):
    model, pool, example = trained(mch, wide=False)
    m = export(model, (jnp.ones((4, NUM_DENSE)), example), tmp_path / "mch")
    assert m["ids_dtype"] == "int32" and m["raw_id_features"] == list(KEYS)
    loaded = load(tmp_path / "mch")
    rng = np.random.default_rng(2)
    raw = query(rng, pool, [5000, 2**31 - 1, 77], 5)  # raw ids past num_embeddings=32
    dense = rng.normal(size=(5, NUM_DENSE)).astype(np.float32)
    want = eval_forward(model, dense, raw, wide=False)
    np.testing.assert_allclose(loaded(dense, raw), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match=r"id 2147483648 does not fit int32"):
        loaded(dense[:1], {"user": [[2**31]], "item": [[]]})
    with pytest.raises(InputError, match="ids must be a flat list of integers"):
        loaded(dense[:1], {"user": [[0.5]], "item": [[]]})


def test_export_leaves_the_model_training(dynamic):
    """Export evaluates a copy: the model's own managed-collision modules still train."""
    model = dynamic[0]
    assert model.sparse.deterministic is None
    mcs = model.sparse.managed_collision_collection.managed_collision_modules
    assert all(not mc.deterministic for mc in mcs.values())
    assert jax.dtypes.issubdtype(model.sparse.reset_rngs.reset.key[...].dtype, jax.dtypes.prng_key)
