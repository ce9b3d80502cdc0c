"""jaxrec.ops.init: Philox by element, the same values for any rows and columns, few compiles.

The reference is a numpy Philox4x32-10 written here from the Random123 paper (uint64
products), checked against Random123's published known-answer vectors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxrec as jr
from jaxrec.ops import init
from jaxrec.xla import philox

M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
MASK = np.uint64(0xFFFFFFFF)


def np_philox(c, k):
    """Philox4x32-10 in numpy: ``c`` four uint32 arrays, ``k`` two uint32 scalars."""
    c = [np.asarray(x, np.uint64) for x in c]
    k0, k1 = np.uint64(k[0]), np.uint64(k[1])
    for r in range(10):
        if r:
            k0, k1 = (k0 + np.uint64(W0)) & MASK, (k1 + np.uint64(W1)) & MASK
        p0, p1 = c[0] * np.uint64(M0), c[2] * np.uint64(M1)
        c = [
            (p1 >> np.uint64(32)) ^ c[1] ^ k0,
            p1 & MASK,
            (p0 >> np.uint64(32)) ^ c[3] ^ k1,
            p0 & MASK,
        ]
    return [x.astype(np.uint32) for x in c]


def np_values(words, stream, rows, cols, lo, hi):
    """float32 values of elements ``rows x cols`` (1-D index arrays) of ``stream``."""
    r, c = np.meshgrid(np.asarray(rows, np.uint32), np.asarray(cols, np.uint32), indexing="ij")
    out = np_philox([r, np.zeros_like(r), c >> 2, np.full_like(r, stream)], words)
    w = np.choose((c & 3).astype(np.int64), out)
    u = ((w >> 9) | np.uint32(0x3F800000)).view(np.float32) - np.float32(1)
    mid, half = (np.float32(lo) + np.float32(hi)) / 2, (np.float32(hi) - np.float32(lo)) / 2
    x = (u * np.float32(2) - np.float32(1)).astype(np.float64)  # exact, as is half * x
    return (np.float64(half) * x + np.float64(mid)).astype(np.float32)


@pytest.mark.parametrize(
    "counter,key,expected",
    [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_reproduces_random123_known_answers(counter, key, expected):
    assert tuple(int(x) for x in philox.philox4x32(counter, key)) == expected
    assert tuple(int(x) for x in np_philox(counter, key)) == expected


def _pieces():
    """Two streams' blocks at arbitrary rows and columns (col0 off the 4-word grid),
    a gap of zero rows, a narrow piece (zero-padded columns)."""
    return [
        init.TablePiece(0, 30, 2, 100, 0, 12, -0.5, 0.5),
        init.TablePiece(35, 17, 5, 0, 5, 7, -0.25, 0.75),
        init.TablePiece(52, 9, 2, 7, 3, 12, -0.5, 0.5),
    ]


@pytest.mark.parametrize("implementation", ["xla", None])
def test_pieces_equal_the_numpy_reference(implementation):
    key = jax.random.key(11)
    words = np.asarray(philox.key_words(key))
    got = np.asarray(
        init.uniform_rows(key, _pieces(), 70, 12, jnp.float32, implementation=implementation)
    )
    want = np.zeros((70, 12), np.float32)
    for p in _pieces():
        want[p.offset : p.offset + p.nrows, : p.width] = np_values(
            words,
            p.stream,
            range(p.row0, p.row0 + p.nrows),
            range(p.col0, p.col0 + p.width),
            p.lo,
            p.hi,
        )
    np.testing.assert_array_equal(got, want)
    assert not got[30:35].any() and not got[35:52, 7:].any() and not got[61:].any()


def test_a_block_of_rows_and_columns_equals_the_same_block_of_the_whole_table():
    key = jax.random.key(3)
    whole = np.asarray(
        init.uniform_rows(key, [init.TablePiece(0, 100, 4, 0, 0, 10, -1, 1)], 100, 10, jnp.float32)
    )
    for r0, nr, c0, w in [(0, 100, 0, 10), (13, 40, 0, 10), (99, 1, 9, 1), (50, 20, 3, 6)]:
        block = np.asarray(
            init.uniform_rows(
                key, [init.TablePiece(0, nr, 4, r0, c0, w, -1, 1)], nr, w + 2, jnp.float32
            )
        )
        np.testing.assert_array_equal(block[:, :w], whole[r0 : r0 + nr, c0 : c0 + w])
        assert not block[:, w:].any()


def test_eager_traced_and_blocked_draws_agree(monkeypatch):
    key = jax.random.key(7)
    eager = np.asarray(init.uniform_rows(key, _pieces(), 70, 12, jnp.float32))
    traced = jax.jit(lambda k: init.uniform_rows(k, _pieces(), 70, 12, jnp.float32))(key)
    np.testing.assert_array_equal(np.asarray(traced), eager)
    # The XLA path in blocks of rows (the last one starting early, drawing rows again).
    monkeypatch.setattr(philox, "BLOCK_VALUES", 12 * 16)
    blocked = init.uniform_rows(key, _pieces(), 70, 12, jnp.float32, implementation="xla")
    np.testing.assert_array_equal(np.asarray(blocked), eager)


def test_values_are_uniform_in_bounds_and_streams_independent():
    key = jax.random.key(0)
    draw = lambda s: np.asarray(  # noqa: E731
        init.uniform_rows(
            key, [init.TablePiece(0, 300, s, 0, 0, 200, -0.5, 0.25)], 300, 200, jnp.float32
        )
    )
    x, y = draw(0), draw(1)
    assert x.min() >= -0.5 and x.max() < 0.25
    # 60k draws: mean and variance of U(-0.5, 0.25) within a few standard errors.
    assert abs(x.mean() - (-0.125)) < 4 * 0.75 / np.sqrt(12 * x.size)
    assert abs(x.var() - 0.75**2 / 12) < 0.002
    # Deciles equally filled (chi-square, 9 degrees of freedom, p ~ 1e-4 at 33).
    counts = np.histogram(x, bins=10, range=(-0.5, 0.25))[0]
    assert ((counts - x.size / 10) ** 2 / (x.size / 10)).sum() < 33
    # Neighbours along rows and columns, and two streams, uncorrelated.
    for a, b in [(x[:, 1:], x[:, :-1]), (x[1:], x[:-1]), (x, y)]:
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 4 / np.sqrt(a.size)


def test_fp16_and_bf16_cast_like_xla():
    key = jax.random.key(1)
    f32 = init.uniform(key, (50, 8), -1, 1, jnp.float32)
    for dtype in (jnp.float16, jnp.bfloat16):
        got = init.uniform(key, (50, 8), -1, 1, dtype)
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(f32.astype(dtype)))
        rows = init.uniform_rows(key, _pieces(), 70, 12, dtype)
        full = init.uniform_rows(key, _pieces(), 70, 12, jnp.float32)
        np.testing.assert_array_equal(np.asarray(rows), np.asarray(full.astype(dtype)))


def test_dense_draws_are_the_same_eager_and_traced():
    key = jax.random.key(2)
    for shape in [(3,), (37, 5), (2, 3, 700)]:
        eager = init.uniform(key, shape, -0.3, 0.3, jnp.float32)
        traced = jax.jit(lambda k, s=shape: init.uniform(k, s, -0.3, 0.3, jnp.float32))(key)
        assert eager.shape == shape
        np.testing.assert_array_equal(np.asarray(eager), np.asarray(traced))


def _tables(sizes, dim=8):
    return [
        jr.EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{i}"]
        )
        for i, n in enumerate(sizes)
    ]


def test_a_table_s_values_do_not_depend_on_its_group():
    """Table i is stream i: regrouping the other tables, or giving one an init_fn,
    leaves it as is."""
    a = jr.EmbeddingBagCollection(_tables([30, 40, 50]), rngs=nnx.Rngs(0))
    mixed = _tables([30, 40, 50])
    mixed[0] = jr.EmbeddingBagConfig(
        name="t0", embedding_dim=4, num_embeddings=30, feature_names=["f0"]
    )
    mixed[1] = jr.EmbeddingBagConfig(
        name="t1",
        embedding_dim=8,
        num_embeddings=40,
        feature_names=["f1"],
        init_fn=lambda k, s, d: jnp.full(s, 0.5, d),
    )
    b = jr.EmbeddingBagCollection(mixed, rngs=nnx.Rngs(0))
    assert len(a.groups) == 1 and len(b.groups) == 2
    key = "embedding_bags.t2.weight"
    np.testing.assert_array_equal(np.asarray(a.state_dict()[key]), np.asarray(b.state_dict()[key]))
    np.testing.assert_array_equal(np.asarray(b.state_dict()["embedding_bags.t1.weight"]), 0.5)
    bound = 1 / np.sqrt(50)
    w = np.asarray(a.state_dict()[key])
    assert w.min() >= -bound and w.max() <= bound


def test_many_table_sizes_build_with_a_bounded_number_of_compiles():
    """Every table of a group is drawn by one program: distinct sizes compile nothing more."""
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


def test_the_xla_path_s_temporaries_do_not_grow_with_the_buffer():
    """From the compiled program: rows are drawn in blocks, so a buffer 10x larger has the
    same temporaries (the XLA path is what GPUs run)."""
    temps = []
    for rows in (2_000_000, 20_000_000):
        f = lambda k, i, fl, rows=rows: philox.uniform_rows_xla(  # noqa: E731
            k, i, fl, rows=rows, cols=16, dtype=jnp.float32
        )
        args = (
            jax.ShapeDtypeStruct((2,), jnp.uint32),
            jax.ShapeDtypeStruct((3, 6), jnp.int32),
            jax.ShapeDtypeStruct((3, 2), jnp.float32),
        )
        stats = jax.jit(f).trace(*args).lower().compile().memory_analysis()
        assert stats.output_size_in_bytes == rows * 16 * 4
        temps.append(stats.temp_size_in_bytes)
    assert temps[1] == temps[0], temps
    assert temps[0] < philox.BLOCK_VALUES * 4 * 12, temps
