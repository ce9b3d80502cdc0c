"""The C++ fused backward + optimizer update against the XLA path, in place on donated tables."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxrec as jr
from jaxrec import cpu, optim
from jaxrec.embedding import CombinedOptimizer
from jaxrec.embedding.sparse_update import backward_update
from jaxrec.train import init_train_state, make_train_step

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"{cpu.unavailable_reason()}")

OPTIMIZERS = {
    "sgd": optim.sgd(0.1),
    "sgd_decouple": optim.sgd(0.1, weight_decay=0.1, weight_decay_mode="DECOUPLE"),
    "rowwise_adagrad": optim.rowwise_adagrad(0.1),
    "rowwise_adagrad_l2": optim.rowwise_adagrad(0.05, weight_decay=0.01, weight_decay_mode="L2"),
    "adagrad_l2": optim.adagrad(
        optax.linear_schedule(0.1, 0.01, 10), weight_decay=0.1, weight_decay_mode="L2"
    ),
}


def _inputs(rng, r, d, c, n, dtype, opt):
    table = jnp.asarray(rng.standard_normal((r, d)), dtype)
    state = opt.init(r, d)
    state = state._replace(**{f: getattr(state, f) + 0.25 for f in state._fields[1:]})
    out_grad = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    seg = rng.integers(0, n, c).astype(np.int32)
    scale = rng.random(c).astype(np.float32)
    rows = rng.integers(0, r, c).astype(np.int32)
    rows[: c // 4] = 3  # one row touched many times
    valid = rng.random(c) < 0.85  # invalid ids must not touch their row
    rows[~valid & (rng.random(c) < 0.5)] = r + 5
    return table, state, out_grad, seg, scale, rows, valid


def _update(opt, impl):
    fn = lambda *a: backward_update(opt, *a, implementation=impl)
    return jax.jit(fn, donate_argnums=(0, 1))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("dtype", "dim"), [(jnp.float32, 12), (jnp.bfloat16, 7)])
def test_backward_update_matches_xla(name, dtype, dim):
    opt = OPTIMIZERS[name]
    rng = np.random.default_rng(dim)
    args = _inputs(rng, 50, dim, 400, 60, dtype, opt)
    untouched = ~np.isin(np.arange(50), args[5][args[6]])
    cpu_step, xla_step = _update(opt, "cpu"), _update(opt, "xla")
    got = cpu_step(*jax.tree.map(jnp.copy, args))
    want = xla_step(*jax.tree.map(jnp.copy, args))
    for _ in range(2):  # more steps: state (and the schedule) carried
        got = cpu_step(*got, *args[2:])
        want = xla_step(*want, *args[2:])
    tol = 2e-6 if dtype == jnp.float32 else 1e-2  # bf16: one rounding of a nearby value
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol
        )
    np.testing.assert_array_equal(np.asarray(got[0])[untouched], np.asarray(args[0])[untouched])


def test_update_is_in_place_under_donation():
    opt = optim.rowwise_adagrad(0.1)
    r, d = 100_000, 16
    args = _inputs(np.random.default_rng(0), r, d, 256, 32, jnp.float32, opt)
    step = _update(opt, "cpu")
    compiled = step.lower(*args).compile()
    text = compiled.as_text()
    assert "jaxrec_backward_update_rowwise_adagrad" in text
    assert not re.search(r"= f32\[100000,16\]\{1,0\} copy\(", text), "the table was copied"
    mem = compiled.memory_analysis()
    table_bytes = r * d * 4
    assert mem.alias_size_in_bytes >= table_bytes + r * 4, mem
    assert mem.temp_size_in_bytes < table_bytes / 4, mem
    before = args[0].unsafe_buffer_pointer()
    table, _ = step(*args)
    assert table.unsafe_buffer_pointer() == before  # written where it was


def test_the_kernel_is_picked_by_the_optimizer_kind():
    """SGD's kind runs the C++ SGD update; an optimizer of your own (no kind), here SGD
    on doubled gradients, is declined and runs XLA with its own update."""
    sgd = optim.sgd(0.1)
    doubled = optim.SparseOptimizer(
        sgd.init, lambda w, g, s, c, **kw: sgd.update(w, 2.0 * g, s, c, **kw), None, 0.1
    )
    args = _inputs(np.random.default_rng(3), 30, 8, 64, 16, jnp.float32, sgd)
    assert "jaxrec_backward_update_sgd" in _update(sgd, "cpu").lower(*args).as_text()
    assert "jaxrec_backward_update" not in _update(doubled, "cpu").lower(*args).as_text()
    got = _update(doubled, "cpu")(*jax.tree.map(jnp.copy, args))
    want = _update(doubled, "xla")(*jax.tree.map(jnp.copy, args))
    plain = _update(sgd, "xla")(*jax.tree.map(jnp.copy, args))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert not np.allclose(np.asarray(got[0]), np.asarray(plain[0]))


class _Model(nnx.Module):
    def __init__(self, *, rngs):
        tables = [
            jr.EmbeddingBagConfig(
                name="t1", embedding_dim=8, num_embeddings=40, feature_names=["a", "b"]
            ),
            jr.EmbeddingBagConfig(
                name="t2",
                embedding_dim=8,
                num_embeddings=20,
                feature_names=["c"],
                pooling=jr.PoolingType.MEAN,
            ),
        ]
        self.ebc = jr.EmbeddingBagCollection(tables, True, rngs=rngs)
        self.head = nnx.Linear(24, 1, rngs=rngs)

    def __call__(self, kjt):
        return jnp.tanh(self.head(self.ebc(kjt).values())[:, 0])


def _batch(rng, b=6, cap=24):
    keys, lengths, values = ["a", "b", "c"], [], []
    for k in keys:
        ls = rng.integers(0, 5, b)
        ls[0] = 0  # an empty bag
        lengths.append(ls)
        v = rng.integers(0, 40 if k != "c" else 20, cap)
        v[1] = v[0]  # duplicates
        values.append(v)
    kjt = jr.KeyedJaggedTensor(
        keys,
        np.concatenate(values).astype(np.int32),
        rng.random(3 * cap).astype(np.float32),
        lengths=np.concatenate(lengths).astype(np.int32),
        capacities=[cap] * 3,
    )
    return kjt, jnp.asarray(rng.standard_normal(b), jnp.float32)


def _loss(model, batch):
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


@pytest.mark.parametrize("sparse", ["sgd", "rowwise_adagrad"])
def test_train_step_cpu_equals_xla(sparse):
    rng = np.random.default_rng(0)
    batches = [_batch(rng) for _ in range(3)]
    results = {}
    for impl in ("xla", "cpu"):
        opt = CombinedOptimizer(optax.sgd(0.01), OPTIMIZERS[sparse])
        graphdef, state = init_train_state(_Model(rngs=nnx.Rngs(0)), opt)
        step = make_train_step(graphdef, opt, _loss, implementation=impl)
        if impl == "cpu":  # the kernels are in the program, updating the table in place
            text = step.lower(state, batches[0]).compile().as_text()
            assert f"jaxrec_kjt_backward_update_{sparse}" in text
            assert "jaxrec_kjt_embedding_bag" in text
            assert "f32[60,8]" in text and not re.search(r"f32\[60,8\]\{1,0\} copy\(", text)
        for b in batches:
            state, loss, _ = step(state, b)
        results[impl] = state
    for a, b in zip(jax.tree.leaves(results["cpu"]), jax.tree.leaves(results["xla"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_update_per_shard_in_shard_map():
    """Row-wise shards (one block of rows per device) each updated by the kernel."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    opt = optim.rowwise_adagrad(0.1)
    rng = np.random.default_rng(3)
    per, d, c = 16, 8, 40
    table, state, out_grad, _, scale, _, valid = _inputs(
        rng, 8 * per, d, 8 * c, 8, jnp.float32, opt
    )
    rows = rng.integers(0, per, 8 * c).astype(np.int32)  # local rows of each shard
    seg = rng.integers(0, 8, 8 * c).astype(np.int32)
    spec = jax.P("x")

    def per_shard(impl):
        def f(table, m, out_grad, seg, scale, rows, valid):
            st = state._replace(momentum1=m)
            t, st = backward_update(
                opt, table, st, out_grad, seg, scale, rows, valid, implementation=impl
            )
            return t, st.momentum1

        in_specs = (spec, spec, jax.P(), spec, spec, spec, spec)
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=(spec, spec)))

    args = (table, state.momentum1, out_grad, seg, scale, rows, valid)
    sharded = jax.sharding.NamedSharding(mesh, spec)
    args = tuple(
        jax.device_put(a, sharded if i != 2 else jax.sharding.NamedSharding(mesh, jax.P()))
        for i, a in enumerate(args)
    )
    got = per_shard("cpu")(*args)
    want = per_shard("xla")(*args)
    assert "jaxrec_backward_update" in per_shard("cpu").lower(*args).as_text()
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)
