"""A dynamic table trained on a drifting stream of 64-bit ids, against a reference that
keeps each id's embedding and optimizer state in a dict (id -> row), in float64 numpy.

The tables start at zero (``init_fn``), so an admitted id starts from zeros and a
row whose eviction was not reset, or whose optimizer state was not, would differ
from the reference. Rejected ids read zeros and train nothing.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from numpy_optimizers import rowwise_adagrad_row
from zch_reference import FILL, ReferenceZch

import jaxrec as jr
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer
from jaxrec.modules import (
    FrequencyAdmission,
    HashZchEvictionConfig,
    HashZchEvictionPolicyName,
    HashZchManagedCollisionModule,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
)
from jaxrec.sparse.ids64 import to_id_words

B, CAP, DIM, SLOTS, WAYS, LR = 8, 24, 4, 32, 8, 0.3
KEYS = ("user", "item")
V = np.linspace(-1.0, 1.0, 2 * DIM)  # fixed readout of the pooled embeddings


def zeros(key, shape, dtype):
    return jnp.zeros(shape, dtype)


def tables():
    return [
        jr.EmbeddingBagConfig(
            name=f"t_{k}",
            embedding_dim=DIM,
            num_embeddings=SLOTS,
            feature_names=[k],
            init_fn=zeros,
        )
        for k in KEYS
    ]


class Model(nnx.Module):
    def __init__(self, policy, admission, *, rngs):
        cfgs = tables()
        ebc = jr.EmbeddingBagCollection(
            cfgs, rngs=rngs, bounds_check_mode=jr.BoundsCheckMode.IGNORE
        )
        mcs = {
            c.name: HashZchManagedCollisionModule(
                SLOTS,
                ways=WAYS,
                eviction_config=HashZchEvictionConfig(policy=policy),
                admission=admission,
                input_hash_seed=i,
            )
            for i, c in enumerate(cfgs)
        }
        self.sparse = ManagedCollisionEmbeddingBagCollection(
            ebc, ManagedCollisionCollection(mcs, cfgs), rngs=rngs
        )
        self.bias = nnx.Param(jnp.zeros(()))

    def __call__(self, kjt):
        pooled, _ = self.sparse(kjt)
        return pooled.values() @ jnp.asarray(V, jnp.float32) + self.bias[...]


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def stream(rng, steps):
    """Per step: per key a list of B bags of 64-bit ids (drifting Zipf window), labels."""
    for step in range(steps):
        bags = {}
        for j, k in enumerate(KEYS):
            lens = rng.integers(0, 4, B)
            rank = np.minimum(rng.zipf(1.2, lens.sum()) - 1, 60)
            ids = (2**36 * (j + 1) + 5 * step + rank * (2**32 + 3)).astype(np.uint64)
            bags[k] = np.split(ids, np.cumsum(lens)[:-1])
        yield bags, rng.normal(size=B).astype(np.float32)


def as_kjt(bags):
    values, lengths, caps = [], [], []
    for k in KEYS:
        flat = np.concatenate(bags[k]).astype(np.uint64)
        words = np.zeros((CAP, 2), np.uint32)
        words[: len(flat)] = to_id_words(flat)
        values.append(words)
        lengths += [len(b) for b in bags[k]]
        caps.append(CAP)
    return jr.KeyedJaggedTensor.from_parts(
        list(KEYS),
        jnp.asarray(np.concatenate(values)),
        jnp.asarray(lengths, jnp.int32),
        capacities=caps,
        stride=B,
    )


class Reference:
    """Per key: the index, and a dict id -> (embedding, adagrad state) in float64."""

    def __init__(self, policy, admission):
        self.index = {
            k: ReferenceZch(SLOTS, WAYS, policy=policy, admission=admission, seed=i)
            for i, k in enumerate(KEYS)
        }
        self.emb = {k: {} for k in KEYS}
        self.bias = 0.0
        self.evicted = self.rejected = 0

    def step(self, bags, y):
        for k in KEYS:  # admissions and evictions first (evict, reset, lookup)
            ids = [int(i) for bag in bags[k] for i in bag]
            rows, evicted, counts = self.index[k].train(ids)
            self.evicted += len(evicted)
            self.rejected += counts["rejected"]
            held = self.index[k].slot_of
            self.emb[k] = {i: e for i, e in self.emb[k].items() if i in held}
            for i, r in zip(ids, rows, strict=True):
                if r != FILL and i not in self.emb[k]:
                    self.emb[k][i] = (np.zeros(DIM), 0.0)
        pooled = np.zeros((B, 2 * DIM))
        for j, k in enumerate(KEYS):
            for b, bag in enumerate(bags[k]):
                for i in bag:
                    if int(i) in self.emb[k]:
                        pooled[b, j * DIM : (j + 1) * DIM] += self.emb[k][int(i)][0]
        pred = pooled @ V + self.bias
        loss = np.mean((pred - y) ** 2)
        d_pred = 2 * (pred - y) / B
        self.bias -= 0.1 * d_pred.sum()
        for j, k in enumerate(KEYS):
            grads = {}
            for b, bag in enumerate(bags[k]):
                for i in bag:
                    if int(i) in self.emb[k]:
                        g = d_pred[b] * V[j * DIM : (j + 1) * DIM]
                        grads[int(i)] = grads.get(int(i), 0) + g
            for i, g in grads.items():
                w, st = self.emb[k][i]
                w, new = rowwise_adagrad_row(w, g, {"momentum1": st}, 1, LR)
                self.emb[k][i] = (w, new["momentum1"])
        return loss


P = HashZchEvictionPolicyName


@pytest.mark.parametrize(
    "policy,admission",
    [(P.LRU_EVICTION, None), (P.LFU_EVICTION, ("freq", 2))],
)
def test_dynamic_table_trains_like_a_dict_of_ids(policy, admission):
    adm = FrequencyAdmission(threshold=admission[1]) if admission else None
    model = Model(policy, adm, rngs=nnx.Rngs(0))
    opt = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(LR))
    rng = np.random.default_rng(1)
    batches = list(stream(rng, 8))
    model.sparse.ensure_buffers(as_kjt(batches[0][0]))
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    ref = Reference(policy.name.split("_")[0].lower(), admission)
    for bags, y in batches:
        state, loss, _ = step(state, (as_kjt(bags), jnp.asarray(y)))
        want = ref.step(bags, y)
        assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-6)
    m = nnx.merge(graphdef, state.params, state.tables, state.rest)
    weights = np.asarray(m.sparse._embedding_module.weights["fp32_d4"].get_value())
    for j, k in enumerate(KEYS):
        for i, (w, _) in ref.emb[k].items():
            row = j * SLOTS + ref.index[k].slot_of[i]
            np.testing.assert_allclose(weights[row], w, rtol=1e-5, atol=1e-6)
        held = {ref.index[k].slot_of[i] for i in ref.emb[k]}
        empty = [j * SLOTS + s for s in range(SLOTS) if s not in held]
        np.testing.assert_array_equal(weights[empty], 0.0)  # rejected ids trained nothing
    assert ref.evicted > 0 and (ref.rejected > 0 or admission is None), "no evictions"
