"""jaxrec.ops.init: chunked uniform draws, the same values on every path, few compiles."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxrec as jr
from jaxrec.ops import init


def _draws(key):
    return [init.Draw(key, 3, (1000, 37), -0.5, 0.25), init.Draw(key, 9, (2, 37), -1.0, 1.0)]


def test_host_device_and_traced_paths_agree():
    key = jax.random.key(7)
    host = np.asarray(init.stacked(_draws(key), jnp.float32))
    device = np.asarray(init._on_device(_draws(key), jnp.float32))
    traced = np.asarray(jax.jit(lambda k: init.stacked(_draws(k), jnp.float32))(key))
    np.testing.assert_array_equal(host, device)
    np.testing.assert_array_equal(host, traced)
    assert host.shape == (1002, 37)


def test_large_tables_written_in_place_on_device_equal_the_host_path(monkeypatch):
    """Above HOST_LIMIT tables are written chunk by chunk into one donated buffer; a dim
    that does not divide the chunk makes chunks start mid-row."""
    key = jax.random.key(5)
    draws = _draws(key) + [init.Draw(key, 4, (3000, 37), 0.0, 2.0)]
    host = np.asarray(init.stacked(draws, jnp.float32))
    monkeypatch.setattr(init, "HOST_LIMIT", 0)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = init.stacked(draws, dtype)
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got), host.astype(dtype))


def test_values_are_uniform_in_bounds():
    x = np.asarray(init.uniform(jax.random.key(0), (300, 200), -0.5, 0.25, jnp.float32))
    assert x.min() >= -0.5 and x.max() < 0.25
    # 60k draws: mean and variance of U(-0.5, 0.25) within a few standard errors.
    assert abs(x.mean() - (-0.125)) < 4 * 0.75 / np.sqrt(12 * x.size)
    assert abs(x.var() - 0.75**2 / 12) < 0.002
    # Chunks differ from each other (a chunk key reused would repeat values).
    flat = x.reshape(-1)
    assert not np.array_equal(flat[: init.CHUNK], flat[init.CHUNK : 2 * init.CHUNK])


def test_fp16_and_bf16_cast_like_xla():
    key = jax.random.key(1)
    f32 = init.uniform(key, (50, 8), -1, 1, jnp.float32)
    for dtype in (jnp.float16, jnp.bfloat16):
        got = init.uniform(key, (50, 8), -1, 1, dtype)
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(f32.astype(dtype)))


def _tables(sizes, dim=8):
    return [
        jr.EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{i}"]
        )  # fmt: skip
        for i, n in enumerate(sizes)
    ]


def test_a_table_s_values_do_not_depend_on_its_group():
    """Table i draws from fold_in(key, i): regrouping the other tables leaves it as is."""
    a = jr.EmbeddingBagCollection(_tables([30, 40, 50]), rngs=nnx.Rngs(0))
    mixed = _tables([30, 40, 50])
    mixed[0] = jr.EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=30,
                                     feature_names=["f0"])  # fmt: skip
    b = jr.EmbeddingBagCollection(mixed, rngs=nnx.Rngs(0))
    assert len(a.groups) == 1 and len(b.groups) == 2
    for t in ("t1", "t2"):
        key = f"embedding_bags.{t}.weight"
        np.testing.assert_array_equal(
            np.asarray(a.state_dict()[key]), np.asarray(b.state_dict()[key])
        )
    bound = 1 / np.sqrt(50)
    w = np.asarray(a.state_dict()["embedding_bags.t2.weight"])
    assert w.min() >= -bound and w.max() <= bound


def test_many_table_sizes_build_with_a_bounded_number_of_compiles():
    """Before, every distinct table size compiled its own random draw."""
    events = []
    listener = lambda event, duration, **kw: events.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.jit(lambda x: x * 3 + 1)(jnp.ones(7))  # a control: the listener sees compiles
        control = sum("backend_compile" in e for e in events)
        jr.EmbeddingBagCollection(_tables(range(101, 141)), rngs=nnx.Rngs(0))  # 40 sizes
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert control >= 1, events
    n = sum("backend_compile" in e for e in events) - control
    assert n <= 8, f"{n} compiles for 40 table sizes (46 when each size compiled its own draw)"


def test_zero_sized_draws_are_empty_arrays():
    got = init.uniform(jax.random.key(0), (0, 5), -1, 1, jnp.float32)
    assert got.shape == (0, 5) and got.dtype == jnp.float32


def test_the_device_fill_updates_its_buffer_in_place():
    """From the compiled program: the buffer is aliased to the output, and the
    temporaries are one batch of chunks whatever the table's size."""
    b = init.DEVICE_BATCH
    i32, f32 = jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32)
    keys = jax.ShapeDtypeStruct((b, 2), jnp.uint32)
    impl = jax.random.key_impl(jax.random.key(0))
    temps = []
    for rows in (200_000, 2_000_000):
        buf = jax.ShapeDtypeStruct((rows, 37), jnp.float32)
        args = (buf, keys, i32, i32, f32, f32, i32, i32, i32)
        stats = init._fill.trace(*args, impl=impl).lower().compile().memory_analysis()
        assert stats.alias_size_in_bytes >= rows * 37 * 4
        temps.append(stats.temp_size_in_bytes)
    assert temps[1] == temps[0], temps  # a table 10x larger, the same temporaries
