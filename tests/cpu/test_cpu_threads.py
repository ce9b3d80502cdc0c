"""The C++ kernels at sizes that split work over threads (the others are too small).

A kernel splits its work when it touches more than ~256 KiB; its workers live
across calls, and a call made while another holds them (another device's
thread, under ``shard_map``) starts its own. Checked against the XLA path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrec import cpu, optim
from jaxrec.cpu import loader
from jaxrec.embedding.sparse_update import backward_update
from jaxrec.ops import embedding_bag
from jaxrec.xla.lookup import embedding_bag_xla

pytestmark = [
    pytest.mark.skipif(not cpu.available(), reason=f"{cpu.unavailable_reason()}"),
    pytest.mark.skipif(
        cpu.available() and loader.build_info()["max_threads"] < 2,
        reason="one core: the kernels run single-threaded (set JAXREC_CPU_THREADS=2)",
    ),
]

R, D, C, S = 5000, 64, 20_000, 2000  # 5 MB of rows read: split over the threads
EPS32 = float(np.finfo(np.float32).eps)


def _ids(rng):
    rows = rng.integers(0, R, C).astype(np.int32)
    rows[:500] = 11  # a row read many times
    seg = np.sort(rng.integers(0, S, C)).astype(np.int32)
    scale = rng.random(C).astype(np.float32)
    return rows, seg, scale


def test_threaded_lookup_and_update_match_xla_on_every_call():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((R, D)), jnp.float32)
    rows, seg, scale = _ids(rng)
    want = jax.jit(embedding_bag_xla, static_argnums=3)(w, rows, seg, S, scale)
    for _ in range(3):  # the same workers, woken again
        got = embedding_bag(w, rows, seg, S, scale, implementation="cpu")
        np.testing.assert_array_equal(got, want)  # same float order as XLA

    opt = optim.rowwise_adagrad(0.1)
    out_grad = jnp.asarray(rng.standard_normal((S, D)), jnp.float32)
    valid = np.ones(C, bool)

    def steps(impl):
        table, state = w, opt.init(R, D)
        fn = jax.jit(
            lambda t, s: backward_update(
                opt, t, s, out_grad, seg, scale, rows, valid, implementation=impl
            )
        )
        for _ in range(3):
            table, state = fn(table, state)
        return table, state

    for a, b in zip(jax.tree.leaves(steps("cpu")), jax.tree.leaves(steps("xla")), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)


def test_concurrent_calls_from_devices_match_xla():
    """Eight devices' lookups at once: one holds the workers, the others start threads."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((8 * R, D)), jnp.float32)
    rows = np.concatenate([_ids(rng)[0] for _ in range(8)])  # local rows of each shard
    seg = np.concatenate([_ids(rng)[1] for _ in range(8)])
    spec = jax.P("x")

    def per_shard(impl):
        def f(w, rows, seg):
            return embedding_bag(w, rows, seg, S, None, implementation=impl)

        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))

    sharded = jax.sharding.NamedSharding(mesh, spec)
    args = tuple(jax.device_put(a, sharded) for a in (w, rows, seg))
    want = per_shard("xla")(*args)
    for _ in range(2):
        np.testing.assert_array_equal(per_shard("cpu")(*args), want)
