"""ManagedCollisionEmbeddingBagCollection / ...EmbeddingCollection: forward, validation,
and training (evicted rows and their optimizer state reset in the step)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxrec as jr
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer
from jaxrec.embedding.reset import init_rows
from jaxrec.modules import (
    EVICTION_FILL,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
)

B, CAP = 6, 24
KEYS = ["a", "b", "c"]


def bag_tables():
    return [
        jr.EmbeddingBagConfig(
            name="t1", embedding_dim=4, num_embeddings=16, feature_names=["a", "b"]
        ),
        jr.EmbeddingBagConfig(
            name="t2",
            embedding_dim=8,
            num_embeddings=8,
            feature_names=["c"],
            pooling=jr.PoolingType.MEAN,
        ),
    ]


def make_mcc(tables, policy=LFU_EvictionPolicy, interval=2):
    modules = {
        t.name: MCHManagedCollisionModule(
            t.num_embeddings, eviction_policy=policy(), eviction_interval=interval
        )
        for t in tables
    }
    return ManagedCollisionCollection(modules, tables)


def drifting_batch(rng, step, keys=KEYS):
    """Raw ids near 10**9 from a window that slides with ``step`` (bag 0 of each key empty)."""
    lengths, values = [], []
    for k in keys:
        for b in range(B):
            n = 0 if b == 0 else int(rng.integers(0, 4))
            lo = 10**9 + 3 * step + (100 if k == "c" else 0)
            values.extend(rng.integers(lo, lo + 12, n).tolist())
            lengths.append(n)
    return jr.KeyedJaggedTensor.from_lengths_sync(
        keys, np.asarray(values, np.int32), lengths, capacities={k: CAP for k in keys}
    )


class MCModel(nnx.Module):
    def __init__(self, policy=LFU_EvictionPolicy, *, rngs):
        tables = bag_tables()
        ebc = jr.EmbeddingBagCollection(tables, rngs=rngs)
        self.sparse = ManagedCollisionEmbeddingBagCollection(
            ebc, make_mcc(tables, policy), return_remapped_features=True, rngs=rngs
        )
        self.head = nnx.Linear(4 + 4 + 8, 1, rngs=rngs)

    def __call__(self, kjt):
        pooled, remapped = self.sparse(kjt)
        return self.head(pooled.values())[:, 0], remapped


class RefModel(nnx.Module):
    """The same tables and head, looked up with already-remapped rows."""

    def __init__(self, *, rngs):
        self.ebc = jr.EmbeddingBagCollection(bag_tables(), rngs=rngs)
        self.head = nnx.Linear(4 + 4 + 8, 1, rngs=rngs)

    def __call__(self, kjt):
        return self.head(self.ebc(kjt).values())[:, 0], kjt


def loss_fn(model, batch):
    kjt, y = batch
    pred, remapped = model(kjt)
    return jnp.mean((pred - y) ** 2), remapped


fresh_rows = jax.jit(init_rows, static_argnums=0)


@nnx.jit
def remap(mcc, kjt):
    return mcc(kjt), mcc.evict()


def deep_copy(module):
    """A copy owning its arrays (``nnx.clone`` shares them; the step donates them)."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


def copy_np(tree):
    return jax.tree.map(np.array, tree)


def looked_up(kjt):
    """Row ids each table read in this batch (from the remapped KJT)."""
    out = {"t1": set(), "t2": set()}
    for k in KEYS:
        jt = kjt[k]
        ids = np.asarray(jt.values())[: int(jt.lengths().sum())].tolist()
        out["t2" if k == "c" else "t1"] |= set(ids)
    return out


@pytest.mark.parametrize("policy", [LFU_EvictionPolicy, LRU_EvictionPolicy])
def test_train_step_equals_remap_reset_then_plain_step(policy):
    """MC-EBC step == (MCC remap, evicted rows and state reset by hand, plain EBC step)."""
    rng = np.random.default_rng(0)
    opt = CombinedOptimizer(optax.sgd(0.05), optim.rowwise_adagrad(0.2))
    model = MCModel(policy, rngs=nnx.Rngs(0))
    model.sparse.ensure_buffers(drifting_batch(rng, 0))
    ref_mcc = deep_copy(model.sparse.managed_collision_collection)
    reset_stream = deep_copy(model.sparse.reset_rngs)
    graphdef, state = train.init_train_state(model, opt)
    ref_graphdef, ref_state = train.init_train_state(RefModel(rngs=nnx.Rngs(1)), opt)
    ref_state = ref_state._replace(params=jax.tree.map(jnp.copy, state.params))  # same head
    step = train.make_train_step(graphdef, opt, loss_fn, has_aux=True)
    ref_step = train.make_train_step(ref_graphdef, opt, loss_fn, has_aux=True)
    tables = {
        g: np.array(v.get_value())
        for g, v in state.tables["sparse"]["_embedding_module"]["weights"].items()
    }
    sparse = {k.split("/")[-1]: v for k, v in copy_np(state.opt_state.sparse).items()}
    group = {"t1": "fp32_d4", "t2": "fp32_d8"}
    configs = {t.name: t for t in bag_tables()}
    fresh_unread = 0
    for i in range(8):
        kjt, y = drifting_batch(rng, i), jnp.asarray(rng.normal(size=B), jnp.float32)
        # Reference: remap with a twin MCC, reset by hand, step the plain EBC on the rows.
        rows_kjt, evicted = remap(ref_mcc, kjt)
        evicted = {t: np.asarray(r) for t, r in evicted.items()}
        key = reset_stream.reset()
        expected_fresh = {}
        for ti, (t, rows) in enumerate(evicted.items()):
            real = rows != EVICTION_FILL
            draw = fresh_rows(configs[t], jax.random.fold_in(key, ti), np.where(real, rows, 0))
            rows, fresh = rows[real], np.asarray(draw)[real]
            assert np.all((rows >= 0) & (rows < configs[t].num_embeddings))
            tables[group[t]][rows] = fresh
            sparse[group[t]].momentum1[rows] = 0.0
            expected_fresh[t] = dict(zip(rows.tolist(), fresh, strict=True))
        ref_tables = jax.tree.map(jnp.copy, ref_state.tables)
        for g, w in tables.items():
            ref_tables["ebc"]["weights"][g].set_value(jnp.asarray(w))
        ref_sparse = {f"ebc/{g}": jax.tree.map(jnp.asarray, st) for g, st in sparse.items()}
        ref_in = ref_state._replace(
            tables=ref_tables, opt_state=ref_state.opt_state._replace(sparse=ref_sparse)
        )
        ref_state, ref_loss, _ = ref_step(ref_in, (rows_kjt, y))

        state, loss, remapped = step(state, (kjt, y))
        np.testing.assert_array_equal(np.asarray(remapped.values()), np.asarray(rows_kjt.values()))
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
        got = {
            g: np.array(v.get_value())
            for g, v in state.tables["sparse"]["_embedding_module"]["weights"].items()
        }
        got_sparse = {k.split("/")[-1]: v for k, v in copy_np(state.opt_state.sparse).items()}
        for g in got:
            want = np.asarray(ref_state.tables["ebc"]["weights"][g].get_value())
            np.testing.assert_allclose(got[g], want, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(
                got_sparse[g].momentum1,
                np.asarray(ref_state.opt_state.sparse[f"ebc/{g}"].momentum1),
                rtol=1e-6,
            )
        # Evicted rows this batch did not read: exactly the fresh draw, momentum initial.
        # Rows neither evicted nor read: bit-identical to before the step.
        read = looked_up(rows_kjt)
        for t, g in group.items():
            for r, fresh in expected_fresh[t].items():
                if r not in read[t]:
                    np.testing.assert_array_equal(got[g][r], fresh)
                    assert got_sparse[g].momentum1[r] == 0
                    fresh_unread += 1
            same = sorted(set(range(configs[t].num_embeddings)) - read[t] - set(expected_fresh[t]))
            np.testing.assert_array_equal(got[g][same], tables[g][same])
        tables, sparse = got, got_sparse
    assert fresh_unread > 0  # the check above ran


def snapshot(module):
    """Every variable but the reset stream (which advances on every call)."""
    return jax.tree.map(np.array, nnx.state(module, nnx.Not(nnx.RngState)))


def test_forward_resets_evicted_rows_before_the_lookup():
    rng = np.random.default_rng(1)
    tables = bag_tables()
    ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
    mc_ebc = ManagedCollisionEmbeddingBagCollection(ebc, make_mcc(tables, interval=1))
    kjt = drifting_batch(rng, 0)
    twin = deep_copy(mc_ebc)
    pooled, none = nnx.jit(lambda m, k: m(k))(mc_ebc, kjt)
    assert none is None and isinstance(pooled, jr.KeyedTensor)
    assert pooled.keys() == ["a", "b", "c"] and pooled.values().shape == (B, 16)
    # By hand: remap, re-initialise the evicted rows, look up.
    rows_kjt, evicted = remap(twin.managed_collision_collection, kjt)
    key = twin.reset_rngs.reset()
    w = {g: np.array(v.get_value()) for g, v in twin.embedding_bag_collection.weights.items()}
    for ti, (t, g) in enumerate((("t1", "fp32_d4"), ("t2", "fp32_d8"))):
        rows = np.asarray(evicted[t])
        rows = rows[rows != EVICTION_FILL]
        assert rows.size > 0  # interval 1: the first call admits this batch's ids
        w[g][rows] = np.asarray(fresh_rows(tables[ti], jax.random.fold_in(key, ti), rows))
        twin.embedding_bag_collection.weights[g].set_value(jnp.asarray(w[g]))
    want = nnx.jit(lambda m, k: m(k).values())(twin.embedding_bag_collection, rows_kjt)
    np.testing.assert_allclose(np.asarray(pooled.values()), np.asarray(want), rtol=1e-6, atol=1e-7)
    for g, v in mc_ebc.embedding_bag_collection.weights.items():
        np.testing.assert_array_equal(np.asarray(v.get_value()), w[g])


def test_eval_calls_reset_nothing_and_keep_the_mapping():
    rng = np.random.default_rng(2)
    tables = bag_tables()
    ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
    mc_ebc = ManagedCollisionEmbeddingBagCollection(
        ebc, make_mcc(tables, interval=1), return_remapped_features=True
    )
    kjt, other = drifting_batch(rng, 0), drifting_batch(rng, 5)
    call = nnx.jit(lambda m, k, d: m(k, deterministic=d), static_argnums=2)
    _, first = call(mc_ebc, kjt, None)  # training: evicts (admits) and resets
    assert any(np.any(np.asarray(r) != EVICTION_FILL) for r in mc_ebc.evict().values())
    before = snapshot(mc_ebc)
    _, by_argument = call(mc_ebc, kjt, True)
    mc_ebc.eval()  # flax's mode switch reaches the wrapper and the MC modules
    assert mc_ebc.deterministic is True
    call(mc_ebc, other, None)  # unseen ids: misses, nothing admitted
    _, by_mode = call(mc_ebc, kjt, None)
    for again in (by_argument, by_mode):
        np.testing.assert_array_equal(np.asarray(again.values()), np.asarray(first.values()))
    after = snapshot(mc_ebc)
    for (path, a), (_, b) in zip(nnx.to_flat_state(before), nnx.to_flat_state(after), strict=True):
        np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(path))
    mc_ebc.train()
    call(mc_ebc, other, None)
    trained = snapshot(mc_ebc)["_embedding_module"]["weights"]["fp32_d4"].get_value()
    assert not np.array_equal(trained, after["_embedding_module"]["weights"]["fp32_d4"].get_value())


def test_sequence_collection_trains_and_returns_remapped_ids():
    rng = np.random.default_rng(3)
    tables = [
        jr.EmbeddingConfig(name="s", embedding_dim=4, num_embeddings=12, feature_names=["a", "b"])
    ]

    class SeqModel(nnx.Module):
        def __init__(self, rngs):
            ec = jr.EmbeddingCollection(tables, need_indices=True, rngs=rngs)
            self.mc = ManagedCollisionEmbeddingCollection(ec, make_mcc(tables), rngs=rngs)
            self.w = nnx.Param(jnp.ones((4,)))

        def __call__(self, kjt):
            out, none = self.mc(kjt)
            assert none is None
            return sum(jnp.sum(jt.values() @ self.w) for jt in out.values()), out

    model = SeqModel(nnx.Rngs(0))
    kjt = drifting_batch(rng, 0, keys=["a", "b"])
    model.mc.ensure_buffers(kjt)
    opt = CombinedOptimizer(optax.sgd(0.0), optim.adagrad(0.5))
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, lambda m, k: m(k), has_aux=True)

    def weights(state):
        return state.tables["mc"]["_embedding_module"]["weights"]["fp32_d4"]

    seen_fresh = 0
    for i in range(6):
        kjt = drifting_batch(rng, i, keys=["a", "b"])
        w0 = np.array(weights(state).get_value())
        state, _, out = step(state, kjt)
        w1 = np.asarray(weights(state).get_value())
        acc = np.asarray(state.opt_state.sparse["mc/_embedding_module/fp32_d4"].momentum1)
        evicted = np.asarray(
            state.rest["mc"]["_managed_collision_collection"]["managed_collision_modules"]["s"][
                "evicted"
            ].get_value()
        )
        evicted = set(evicted[evicted != EVICTION_FILL].tolist())
        read = set()
        for k in ("a", "b"):
            jt = out[k]
            n = int(jt.lengths().sum())
            ids = np.asarray(jt.weights())[:n]  # need_indices: the remapped rows
            assert np.all((ids >= 0) & (ids < 12))
            read |= set(ids.tolist())
        for r in evicted - read:  # evicted, not read: fresh weights (in range), no state
            assert np.all(np.abs(w1[r]) <= 0.5) and not np.array_equal(w1[r], w0[r])
            assert np.all(acc[r] == 0)
            seen_fresh += 1
        same = sorted(set(range(12)) - read - evicted)
        np.testing.assert_array_equal(w1[same], w0[same])
    assert seen_fresh > 0
    assert step.jitted._cache_size() == 1  # one compile for the stream


def test_validation_errors():
    tables = bag_tables()
    ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"same tables: only in the embedding collection \['t2'\]"):
        ManagedCollisionEmbeddingBagCollection(ebc, make_mcc(tables[:1]))
    other = [
        tables[0],
        jr.EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=8, feature_names=["z"]),
    ]
    with pytest.raises(ValueError, match=r"table 't2' reads features \['c'\]"):
        ManagedCollisionEmbeddingBagCollection(ebc, make_mcc(other))
    bigger = [
        tables[0],
        jr.EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=9, feature_names=["c"]),
    ]
    with pytest.raises(ValueError, match=r"num_embeddings=8 but .* output_size\(\)=9"):
        ManagedCollisionEmbeddingBagCollection(ebc, make_mcc(bigger))
    with pytest.raises(TypeError, match="needs an EmbeddingCollection"):
        ManagedCollisionEmbeddingCollection(ebc, make_mcc(tables))
    with pytest.raises(TypeError, match="must be a ManagedCollisionCollection"):
        ManagedCollisionEmbeddingBagCollection(ebc, {"t1": None})
