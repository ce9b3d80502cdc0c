"""The C++ CPU lookups (``implementation="cpu"``) against the XLA reference.

Pooled outputs are summed in the XLA path's order (rounded products, sums in
id order), so they are expected to agree to float32 rounding or better.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxrec as jr
from jaxrec import cpu
from jaxrec.cpu import loader
from jaxrec.ops import BoundsCheckMode, FeatureSlot, dispatch, embedding_bag, grouped_pooled_lookup
from jaxrec.xla.lookup import embedding_bag_xla

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"{cpu.unavailable_reason()}")

TOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-6}  # fp32 accumulation either way
EPS32 = float(np.finfo(np.float32).eps)


def ragged_segments(rng, c, s):
    """Unsorted segment ids: empty bags, one huge bag, padding (``>= s``), runs split in two."""
    seg = rng.integers(0, s, c)
    seg[: c // 3] = 1  # one huge bag
    seg[rng.random(c) < 0.1] = s + 2  # padding
    seg[0] = 0
    seg[-1] = 0  # bag 0 in two non-adjacent runs
    empty = np.arange(s) % 5 == 3
    seg[np.isin(seg, np.flatnonzero(empty))] = s  # every fifth bag empty
    return seg.astype(np.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dim", [4, 7, 48, 100, 256])
def test_embedding_bag_matches_xla(dtype, dim):
    rng = np.random.default_rng(dim)
    r, c, s = 40, 300, 23
    w = jnp.asarray(rng.standard_normal((r, dim)), dtype)
    rows = rng.integers(0, r, c).astype(np.int32)
    rows[:20] = 7  # duplicates
    rows[20:25] = [-3, r, r + 10, -1, 2 * r]  # clamped, as XLA's mode="clip"
    seg = ragged_segments(rng, c, s)
    scale = rng.random(c).astype(np.float32)
    for sc in (None, scale):
        got = embedding_bag(w, rows, seg, s, sc, implementation="cpu")
        want = jax.jit(embedding_bag_xla, static_argnums=3)(w, rows, seg, s, sc)
        assert got.dtype == jnp.float32 and got.shape == (s, dim)
        # XLA may sum a long segment in another order: rounding scaled by its length
        atol = 4 * EPS32 * np.bincount(seg).max() * float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=atol)


def test_embedding_bag_empty_and_vmap_and_grad():
    w = jnp.ones((5, 8), jnp.float32)
    empty = embedding_bag(
        w, jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32), 3, None, implementation="cpu"
    )
    np.testing.assert_array_equal(empty, np.zeros((3, 8)))
    rows, seg = jnp.asarray([0, 1, 1, 4]), jnp.asarray([0, 0, 2, 2])
    ws = jnp.arange(2 * 5 * 8, dtype=jnp.float32).reshape(2, 5, 8)
    batched = jax.vmap(lambda w: embedding_bag(w, rows, seg, 3, implementation="cpu"))(ws)
    for i in range(2):
        np.testing.assert_array_equal(batched[i], embedding_bag_xla(ws[i], rows, seg, 3))
    sc = jnp.asarray([0.5, 2.0, 1.0, 3.0])
    f = lambda impl: jax.grad(
        lambda w, s: jnp.sum(embedding_bag(w, rows, seg, 3, s, implementation=impl) ** 2),
        argnums=(0, 1),
    )(ws[0], sc)
    for a, b in zip(f("cpu"), f("xla"), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def _kjt(rng, weighted=True):
    """Three keys, B=5: empty bags, a key with no ids, one large bag, duplicates, bad ids."""
    lengths = np.array([0, 3, 1, 0, 7, 2, 2, 0, 1, 1, 9, 0, 0, 0, 0], np.int32)
    caps = [12, 8, 12]
    values = rng.integers(0, 10, sum(caps)).astype(np.int32)
    values[3:6] = 4  # duplicates in one bag
    values[7] = -2  # out of range (key a)
    values[13] = 10  # out of range (key b: num_embeddings 10)
    weights = rng.random(values.size).astype(np.float32) if weighted else None
    return jr.KeyedJaggedTensor(["a", "b", "c"], values, weights, lengths=lengths, capacities=caps)


SLOTS = [
    FeatureSlot(key="b", row_offset=0, num_embeddings=10, pooling=jr.PoolingType.MEAN),
    FeatureSlot(key="a", row_offset=10, num_embeddings=10),
    FeatureSlot(key="c", row_offset=20, num_embeddings=10, pooling=jr.PoolingType.MEAN),
    FeatureSlot(key="a", row_offset=0, num_embeddings=10),  # a key read twice
]


def _lookup(impl, mode, weighted):
    def f(w, kjt):
        return grouped_pooled_lookup(
            w, kjt, SLOTS, is_weighted=weighted, bounds_check_mode=mode, implementation=impl
        )

    return jax.jit(f)


def _all_lookups(impl):
    """Both bounds modes that drop or clamp silently, weighted and not: one compile."""

    def f(w, kjt):
        return [
            grouped_pooled_lookup(
                w, kjt, SLOTS, is_weighted=weighted, bounds_check_mode=mode, implementation=impl
            )
            for mode in (BoundsCheckMode.NONE, BoundsCheckMode.IGNORE)
            for weighted in (False, True)
        ]

    return jax.jit(f)


@pytest.mark.parametrize(
    ("dtype", "dim"),
    [
        (jnp.float32, 4),
        (jnp.float32, 13),
        (jnp.float32, 64),  # whole native vectors: the unrolled path
        (jnp.float32, 128),
        (jnp.float32, 256),
        (jnp.float32, 272),  # more vectors than the unrolled path takes
        (jnp.bfloat16, 4),
        (jnp.bfloat16, 96),
    ],
)
def test_grouped_lookup_matches_xla(dtype, dim):
    rng = np.random.default_rng(dim)
    w = jnp.asarray(rng.standard_normal((30, dim)), dtype)
    kjt = _kjt(rng)
    got, want = _all_lookups("cpu")(w, kjt), _all_lookups("xla")(w, kjt)
    for a, b in zip(got, want, strict=True):
        assert a.shape == (5, len(SLOTS), dim)
        np.testing.assert_allclose(a, b, rtol=TOL[dtype], atol=TOL[dtype])


def test_grouped_lookup_bounds_warning_and_fatal(caplog):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((30, 8)), jnp.float32)
    kjt = _kjt(rng)
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        got = _lookup("cpu", BoundsCheckMode.WARNING, True)(w, kjt)
        jax.block_until_ready(got)
    # ids -2 (read by two slots) and 10: three drops, the first one -2
    assert "3 ids out of range" in caplog.text and "e.g. id 10" in caplog.text
    want = _lookup("xla", BoundsCheckMode.IGNORE, True)(w, kjt)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(Exception, match="ids out of range"):
        jax.block_until_ready(_lookup("cpu", BoundsCheckMode.FATAL, True)(w, kjt))


def test_grouped_lookup_grad_is_xla():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((30, 8)), jnp.float32)
    kjt = _kjt(rng)

    def g(impl):
        f = _lookup(impl, BoundsCheckMode.IGNORE, True)
        return jax.grad(lambda w: jnp.sum(jnp.sin(f(w, kjt))))(w)

    np.testing.assert_allclose(g("cpu"), g("xla"), rtol=1e-6, atol=1e-7)


def test_none_picks_cpu_and_compiles_one_ffi_call():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((30, 8)), jnp.float32)
    text = _lookup(None, BoundsCheckMode.IGNORE, True).lower(w, _kjt(rng)).as_text()
    assert text.count("jaxrec_kjt_embedding_bag") == 1


def test_unavailable_falls_back_to_xla_and_warns_once(monkeypatch, caplog):
    monkeypatch.setitem(loader._STATE, "reason", "simulated: no compiler")
    monkeypatch.setitem(loader._STATE, "done", True)
    monkeypatch.setitem(loader._STATE, "warned", False)
    rows, seg = jnp.asarray([0, 1, 1]), jnp.asarray([0, 0, 1])
    w = jnp.arange(12.0).reshape(4, 3)
    with pytest.warns(loader.CpuKernelWarning, match="simulated: no compiler"):
        got = embedding_bag(w, rows, seg, 2, implementation="cpu")
    np.testing.assert_array_equal(got, embedding_bag_xla(w, rows, seg, 2))
    got = embedding_bag(w, rows, seg, 2, implementation="cpu")  # once: no second warning
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        embedding_bag(w, rows, seg, 2)  # None: XLA, silently now
    assert "simulated" not in caplog.text


# ----- per shard, inside shard_map -----


@pytest.mark.parametrize("plan_name", ["table_wise", "row_wise"])
def test_sharded_forward_matches_unsharded(plan_name):
    from sharding_cases import PLANS, Model, batches, mesh_1d

    from jaxrec import distributed as d

    rng = np.random.default_rng(0)
    local, glob = batches(rng, weighted=True)
    ref_model = Model(True, rngs=nnx.Rngs(1))
    ref_model.ebc.implementation = "xla"
    want = np.asarray(ref_model.ebc(glob[0]).values())
    model = Model(True, rngs=nnx.Rngs(1))
    model.ebc.implementation = "cpu"
    gens, _ = PLANS[plan_name]
    mesh = mesh_1d()
    plan = d.construct_module_sharding_plan(model.ebc, gens, world_size=8, local_size=8)
    dmp = d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh)
    kjt = d.shard_batch([k for k, _ in local], mesh)
    fwd = nnx.jit(lambda m, kjt: m.ebc(kjt).values())
    text = fwd.lower(dmp, kjt).as_text()
    # Per shard: table-wise looks up its tables with the module's implementation;
    # row-wise shards pool received ids with ``embedding_bag`` (``None``: CPU by default).
    if plan_name == "table_wise" or dispatch.CPU_BY_DEFAULT:
        assert "jaxrec_embedding_bag" in text or "jaxrec_kjt_embedding_bag" in text
    np.testing.assert_allclose(fwd(dmp, kjt), want, rtol=1e-6, atol=1e-6)
