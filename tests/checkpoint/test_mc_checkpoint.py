"""Managed-collision state is checkpointed with the tables: save, restore, resume gives the
same remapping, evictions, resets and tables as the uninterrupted run."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxrec as jr
from jaxrec import checkpoint as ckpt
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer
from jaxrec.modules import (
    DistanceLFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
)

B, CAP = 8, 32
OPT = CombinedOptimizer(optax.adam(0.01), optim.adam(0.05))


class Model(nnx.Module):
    def __init__(self, *, rngs):
        tables = [
            jr.EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=rows, feature_names=[n])
            for n, rows in (("u", 10), ("i", 12))
        ]
        mcc = ManagedCollisionCollection(
            {
                "u": MCHManagedCollisionModule(
                    10, eviction_policy=LRU_EvictionPolicy(), eviction_interval=2
                ),
                "i": MCHManagedCollisionModule(
                    12, eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=3
                ),
            },
            tables,
        )
        ebc = jr.EmbeddingBagCollection(tables, rngs=rngs)
        self.mc = ManagedCollisionEmbeddingBagCollection(ebc, mcc, True, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, kjt):
        pooled, remapped = self.mc(kjt)
        return self.head(pooled.values())[:, 0], remapped


def loss_fn(model, batch):
    kjt, y = batch
    pred, remapped = model(kjt)
    return jnp.mean((pred - y) ** 2), remapped


def batches(n, seed=0):
    """Ids drifting upwards (evictions every interval), raw values up to ~2**31."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(n):
        lengths = rng.integers(0, 4, 2 * B)
        lo = 2**31 - 1000 + 2 * s
        values = rng.integers(lo, lo + 15, int(lengths.sum())).astype(np.int32)
        kjt = jr.KeyedJaggedTensor.from_lengths_sync(
            ["u", "i"], values, lengths, capacities={"u": CAP, "i": CAP}
        )
        out.append((kjt, jnp.asarray(rng.normal(size=B), jnp.float32)))
    return out


def fresh(seed):
    model = Model(rngs=nnx.Rngs(seed))
    model.mc.ensure_buffers(batches(1)[0][0])
    return train.init_train_state(model, OPT)


def run(step, state, data):
    trace = []
    for batch in data:
        state, loss, remapped = step(state, batch)
        w = state.tables["mc"]["_embedding_module"]["weights"]["fp32_d4"].get_value()
        trace.append((float(loss), np.asarray(remapped.values()), np.array(w)))
    return state, trace


def test_resume_gives_identical_remapping_and_tables(tmp_path):
    data = batches(12)
    graphdef, state = fresh(0)
    step = train.make_train_step(graphdef, OPT, loss_fn, has_aux=True)
    state, _ = run(step, state, data[:6])
    mcs = state.rest["mc"]["_managed_collision_collection"]["managed_collision_modules"]
    saved_ids = np.array(mcs["u"]["sorted_ids"].get_value())
    assert np.sum(saved_ids != 0xFFFFFFFF) > 0  # ids were admitted before the save
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(6, graphdef, OPT, state)
    _, uninterrupted = run(step, state, data[6:])

    graphdef2, target = fresh(1)  # another seed: every value differs until restored
    _, not_restored = run(step, jax.tree.map(jnp.copy, target), data[6:7])
    assert not np.array_equal(not_restored[0][1], uninterrupted[0][1])  # the MC state matters
    with ckpt.CheckpointManager(tmp_path) as mgr:
        restored, at = mgr.resume(graphdef2, OPT, target)
    assert at == 6
    mcs = restored.rest["mc"]["_managed_collision_collection"]["managed_collision_modules"]
    np.testing.assert_array_equal(np.asarray(mcs["u"]["sorted_ids"].get_value()), saved_ids)
    _, resumed = run(step, restored, data[6:])
    for (l1, r1, w1), (l2, r2, w2) in zip(uninterrupted, resumed, strict=True):
        np.testing.assert_array_equal(r2, r1)  # identical remapping
        np.testing.assert_array_equal(w2, w1)  # identical evictions, resets and updates
        assert l1 == l2
