"""``implementation=`` dispatch to the Pallas kernels: defaults, forcing, fallback, gradients."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import LENGTHS, TABLE_ROWS

from jaxrec import KeyedJaggedTensor, PoolingType, optim
from jaxrec.embedding import CombinedOptimizer
from jaxrec.embedding.optimizer import SubGroup
from jaxrec.embedding.sparse_update import update_subgroup
from jaxrec.ops import (
    FeatureSlot,
    backends,
    grouped_pooled_lookup,
    pooled_lookup,
    sequence_lookup,
)
from jaxrec.ops.dispatch import dispatch


def test_importing_jaxrec_loads_no_cpu_extension():
    """The API imports its backends' Python wrappers; the C++ extension still loads only
    when a CPU kernel may run (never for ``implementation="xla"``)."""
    code = (
        "import sys, jax.numpy as jnp, jaxrec\n"
        "from jaxrec.ops import pooled_lookup\n"
        "assert 'jaxrec.pallas' in sys.modules and 'jaxrec.cpu' in sys.modules\n"
        "args = jnp.ones((4, 8)), jnp.array([1, 2]), jnp.array([2])\n"
        "pooled_lookup(*args, implementation='xla')\n"
        "assert 'jaxrec.cpu._kernels' not in sys.modules, 'loaded eagerly'\n"
        "pooled_lookup(*args, implementation='cpu')\n"
        "from jaxrec.cpu import loader\n"
        "assert ('jaxrec.cpu._kernels' in sys.modules) == loader.available()\n"
    )
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_default_is_xla_off_gpu_and_fallback_on_not_implemented(monkeypatch):
    calls = []

    def kernel(x, *, interpret):
        calls.append(x)
        if x < 0:
            raise NotImplementedError("declined")
        return "pallas"

    monkeypatch.setitem(backends.PALLAS, "_probe", kernel)
    monkeypatch.setitem(backends.GPU_DEFAULT_PALLAS, "_probe", "a test kernel")
    xla = lambda x: "xla"
    expected_default = "pallas" if jax.default_backend() == "gpu" else "xla"
    assert dispatch("_probe", None, xla, 1) == expected_default
    assert dispatch("_probe", "xla", xla, 1) == "xla"
    assert dispatch("_probe", "pallas", xla, 1) == "pallas"
    assert dispatch("_probe", "pallas", xla, -1) == "xla"  # declined: falls back, no error
    with pytest.raises(NotImplementedError, match="no Pallas kernel"):
        dispatch("_no_such_op", "pallas", xla, 1)


def _kjt(seed):
    """Three features over two stacked tables: mixed tables, MEAN and SUM, weights."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(LENGTHS * 3, np.int32)  # 3 keys x 12 bags, key-major
    n = int(lengths.sum())
    values = rng.integers(0, min(TABLE_ROWS), n + 4).astype(np.int32)  # 4 padding slots
    weights = rng.random(n + 4).astype(np.float32)
    cap = int(np.asarray(LENGTHS).sum())
    return KeyedJaggedTensor(
        ["a", "b", "c"], values, weights, lengths=lengths, capacities=[cap, cap, cap + 4]
    )


SLOTS = [
    FeatureSlot(key="a", row_offset=0, num_embeddings=TABLE_ROWS[0]),
    FeatureSlot(
        key="c", row_offset=TABLE_ROWS[0], num_embeddings=TABLE_ROWS[1], pooling=PoolingType.MEAN
    ),
    FeatureSlot(key="b", row_offset=TABLE_ROWS[0], num_embeddings=TABLE_ROWS[1]),
]


def test_grouped_lookup_pallas_equals_xla_and_gradients_flow():
    kjt = _kjt(0)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(sum(TABLE_ROWS), 12)), jnp.float32)

    def run(impl, w):
        return grouped_pooled_lookup(w, kjt, SLOTS, is_weighted=True, implementation=impl)

    np.testing.assert_allclose(run("pallas", w), run("xla", w), atol=2e-5, rtol=0)
    # jax.grad through the Pallas forward uses the XLA path's autodiff.
    loss = lambda impl: jax.grad(lambda w: jnp.sum(jnp.sin(run(impl, w))))(w)
    np.testing.assert_allclose(loss("pallas"), loss("xla"), atol=1e-5, rtol=0)


def test_single_table_ops_force_pallas_and_fall_back():
    t = jnp.asarray(np.random.default_rng(2).normal(size=(10, 8)), jnp.bfloat16)
    ids, lengths = jnp.asarray([1, 3, 3, 9, 0], jnp.int32), jnp.asarray([2, 0, 3], jnp.int32)
    for fn in (pooled_lookup, sequence_lookup):
        np.testing.assert_allclose(
            np.asarray(fn(t, ids, lengths, implementation="pallas"), np.float32),
            np.asarray(fn(t, ids, lengths, implementation="xla"), np.float32),
            atol=1e-6,
        )
    t6 = t[:, :6]  # dim 6: the kernel declines, XLA answers
    np.testing.assert_array_equal(
        pooled_lookup(t6, ids, lengths, implementation="pallas"),
        pooled_lookup(t6, ids, lengths, implementation="xla"),
    )


@pytest.mark.parametrize("covers", [True, False])
def test_update_subgroup_pallas_equals_xla(covers):
    opt = optim.rowwise_adagrad(0.1)
    r, d = sum(TABLE_ROWS), 12
    if covers:
        sub = SubGroup(opt, (True, True), (0, TABLE_ROWS[0]), r)
    else:  # the optimizer owns only the second table: its state has TABLE_ROWS[1] rows
        sub = SubGroup(opt, (False, True), (0, 0), TABLE_ROWS[1])
    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.normal(size=(r, d)), jnp.float32)
    state = opt.init(sub.num_rows, d)
    unique = jnp.asarray(np.r_[np.sort(rng.choice(r, 20, replace=False)), [r] * 4], jnp.int32)
    grads = jnp.asarray(rng.normal(size=(24, d)), jnp.float32)
    args = (sub, (0, TABLE_ROWS[0]), table, state, unique, grads)
    got = update_subgroup(*args, implementation="pallas")
    want = update_subgroup(*args, implementation="xla")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


TRITON = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("implementation", [None, "pallas", "xla", "cpu"])
def test_the_lowering_platform_picks_the_kernels(implementation):
    """One traced train step, lowered for cuda and for cpu on this (CPU) host: the GPU
    program holds the Triton kernels (forward and fused update) and never the C++ FFI
    calls; the CPU program holds the C++ kernels where ``None``/``"cpu"`` asks for them."""
    import optax
    from flax import nnx

    from jaxrec import EmbeddingBagCollection, EmbeddingBagConfig
    from jaxrec.cpu import loader
    from jaxrec.train import init_train_state, make_train_step

    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=64, feature_names=["a"])]
    model = EmbeddingBagCollection(tables, rngs=nnx.Rngs(0), implementation=implementation)
    opt = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.1))
    graphdef, state = init_train_state(model, opt)
    loss = lambda m, kjt: jnp.sum(m(kjt).values() ** 2)
    step = make_train_step(graphdef, opt, loss, implementation=implementation)
    kjt = KeyedJaggedTensor.from_lengths_sync(["a"], [1, 2, 3, 4], [2, 0, 2], capacities={"a": 8})
    traced = step.jitted.trace(state, kjt)
    gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    pallas_on_gpu = implementation in (None, "pallas")
    assert (gpu.count(TRITON) >= 2) == pallas_on_gpu  # lookup + fused backward update
    assert "@jaxrec_" not in gpu  # custom calls to the C++ kernels (FFI targets)
    assert TRITON not in cpu
    if loader.available():
        assert ("@jaxrec_" in cpu) == (implementation in (None, "cpu"))


def test_gpu_default_follows_the_measured_table(monkeypatch):
    """``None`` on GPUs runs a kernel only while its op is in ``GPU_DEFAULT_PALLAS``;
    ``"pallas"`` forces it either way."""
    from jaxrec.ops import embedding_bag

    args = jnp.ones((16, 8)), jnp.array([1, 2, 3]), jnp.array([0, 0, 1])

    def lowered(implementation):
        fn = lambda w, r, s: embedding_bag(w, r, s, 2, implementation=implementation)
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    assert TRITON in lowered(None)
    monkeypatch.delitem(backends.GPU_DEFAULT_PALLAS, "embedding_bag")
    assert TRITON not in lowered(None)
    assert TRITON in lowered("pallas")
    assert set(backends.GPU_DEFAULT_PALLAS) <= set(backends.PALLAS)


def test_mosaic_gpu_runs_the_mosaic_forward_and_the_default_elsewhere():
    """``"mosaic_gpu"``: the pooled lookup is the Mosaic GPU kernel in a GPU program; an op
    without one (the sequence lookup) runs as with ``None`` (Triton there)."""
    from jaxrec.ops import embedding_bag, embedding_gather

    w, rows, seg = jnp.ones((16, 32)), jnp.array([1, 2, 3]), jnp.array([0, 0, 1])

    def lowered(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    bag = lowered(
        lambda w, r, s: embedding_bag(w, r, s, 2, implementation="mosaic_gpu"), w, rows, seg
    )
    assert "mosaic_gpu" in bag and TRITON not in bag
    gather = lowered(
        lambda w, r: embedding_gather(w, r, r < 8, implementation="mosaic_gpu"), w, rows
    )
    assert TRITON in gather and "mosaic_gpu" not in gather
