"""64-bit ids as uint32 words: round trips, the hash, and every KJT method on words."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrec.sparse import (
    JaggedTensor,
    KeyedJaggedTensor,
    from_id_words,
    hash64_np,
    hash64_words,
    id_words,
    is_wide,
    narrow_ids,
    to_id_words,
)

EXTREMES_I64 = [
    0,
    1,
    -1,
    2**31 - 1,
    2**31,
    -(2**31),
    -(2**31) - 1,
    2**32 - 1,
    2**32,
    2**63 - 1,
    -(2**63),
]
EXTREMES_U64 = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1]


def random_ids(dtype, n=200, seed=0):
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    ids = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    extremes = EXTREMES_I64 if info.min < 0 else EXTREMES_U64
    return np.concatenate([ids, np.asarray(extremes, dtype)])


def words_by_python(ids):
    """Independent reference: the 64-bit pattern of each id by Python integers."""
    return np.asarray([[int(i) % 2**64 & 0xFFFFFFFF, int(i) % 2**64 >> 32] for i in ids], np.uint32)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_id_words_round_trip(dtype):
    ids = random_ids(dtype)
    w = to_id_words(ids)
    assert w.dtype == np.uint32 and w.shape == (len(ids), 2) and is_wide(w)
    np.testing.assert_array_equal(w, words_by_python(ids))
    back = from_id_words(w, signed=dtype == np.int64)
    assert back.dtype == dtype
    np.testing.assert_array_equal(back, ids)
    lo, hi = jax.jit(id_words)(jnp.asarray(w))  # in-graph split of words is the identity
    np.testing.assert_array_equal(np.stack([lo, hi], 1), w)


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int8, np.uint16])
def test_in_graph_words_of_narrow_ids_extend_like_int64(dtype):
    info = np.iinfo(dtype)
    rng = np.random.default_rng(1)
    ids = np.concatenate(
        [
            rng.integers(info.min, info.max, 100, dtype=dtype, endpoint=True),
            np.asarray([info.min, info.max, 0], dtype),
        ]
    )
    lo, hi = jax.jit(id_words)(jnp.asarray(ids))
    want = to_id_words(ids.astype(np.int64))  # sign- or zero-extended by numpy
    np.testing.assert_array_equal(np.stack([lo, hi], 1), want)


def test_narrow_ids_keeps_31_bit_ids_only():
    ids = random_ids(np.int64)
    got = np.asarray(jax.jit(narrow_ids)(jnp.asarray(to_id_words(ids))))
    want = np.where((ids >= 0) & (ids < 2**31), ids, -1).astype(np.int32)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    plain = jnp.asarray([3, -2], jnp.int32)
    assert narrow_ids(plain) is plain


@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1])
@pytest.mark.parametrize("x64", [False, True])
def test_hash64_words_in_jit_equals_numpy(seed, x64):
    ids = random_ids(np.uint64, seed=3)
    w = to_id_words(ids)
    fn = jax.jit(lambda lo, hi: hash64_words(lo, hi, seed=seed))
    if x64:
        with jax.enable_x64(True):
            lo, hi = fn(jnp.asarray(w[:, 0]), jnp.asarray(w[:, 1]))
    else:
        assert not jax.config.jax_enable_x64
        lo, hi = fn(jnp.asarray(w[:, 0]), jnp.asarray(w[:, 1]))
    assert lo.dtype == hi.dtype == jnp.uint32
    got = from_id_words(np.stack([np.asarray(lo), np.asarray(hi)], 1))
    np.testing.assert_array_equal(got, hash64_np(ids, seed=seed))
    np.testing.assert_array_equal(hash64_np(w, seed=seed), hash64_np(ids, seed=seed))
    assert len(np.unique(got)) == len(np.unique(ids))  # a bijection: no collisions


# ----- KeyedJaggedTensor on id words -----
KEYS = ["a", "b", "c"]
# a: [1, 2**40] [] [5]      b: [-1] [2**31, 3] [7]      c: [2**63 - 1] [] [0, 2**32]
BAGS = {
    "a": [[1, 2**40], [], [5]],
    "b": [[-1], [2**31, 3], [7]],
    "c": [[2**63 - 1], [], [0, 2**32]],
}
STRIDE = 3


def packed():
    vals = np.asarray([i for k in KEYS for bag in BAGS[k] for i in bag], np.int64)
    lens = np.asarray([len(bag) for k in KEYS for bag in BAGS[k]], np.int32)
    return vals, lens


def ids_of(jt):
    """The 64-bit ids of a JaggedTensor of words, bag by bag."""
    return [from_id_words(np.asarray(x), signed=True).tolist() for x in jt.to_dense()]


def assert_holds(kjt, keys=KEYS):
    assert kjt.is_wide() and kjt.values().shape[1:] == (2,)
    assert kjt.keys() == list(keys)
    for k in set(keys) & set(BAGS):
        assert ids_of(kjt[k]) == BAGS[k], k


def test_host_int64_past_int32_becomes_words_and_fitting_ids_stay_int32():
    vals, lens = packed()
    kjt = KeyedJaggedTensor.from_lengths_sync(KEYS, vals, lens)
    assert kjt.values().dtype == jnp.uint32
    assert_holds(kjt)
    small = KeyedJaggedTensor.from_lengths_sync(KEYS, np.arange(10, dtype=np.int64), lens)
    assert small.values().dtype == jnp.int32 and not small.is_wide()
    fixed = KeyedJaggedTensor.from_lengths_sync(KEYS, to_id_words(np.arange(10)), lens)
    assert fixed.is_wide()  # the caller fixes the representation
    np.testing.assert_array_equal(
        np.asarray(fixed.narrow_ids().values()), np.asarray(small.values())
    )


def test_constructors_take_words():
    vals, lens = packed()
    offsets = np.concatenate([[0], np.cumsum(lens)])
    w = np.arange(len(vals), dtype=np.float32) + 1
    for kjt in [
        KeyedJaggedTensor.from_lengths_sync(KEYS, to_id_words(vals), lens, w),
        KeyedJaggedTensor.from_offsets_sync(KEYS, vals, offsets, w),
        KeyedJaggedTensor.from_lengths_sync(KEYS, vals, lens, w, on_host=True),
        KeyedJaggedTensor(KEYS, vals, w, lengths=lens),
        KeyedJaggedTensor(KEYS, jnp.asarray(to_id_words(vals)), w, offsets=offsets),
    ]:
        assert_holds(kjt)
        got = [x.tolist() for k in KEYS for x in kjt[k].to_dense_weights()]
        assert sum(got, []) == w.tolist()
    on_host = KeyedJaggedTensor.from_lengths_sync(KEYS, vals, lens, on_host=True)
    assert isinstance(on_host.values(), np.ndarray)
    assert isinstance(on_host.narrow_ids().values(), np.ndarray)  # stays on the host


def test_bad_words_are_refused():
    vals, lens = packed()
    with pytest.raises(ValueError, match="1-D"):  # int32 pairs are not words
        KeyedJaggedTensor(KEYS, to_id_words(vals).astype(np.int32), lengths=lens)
    with pytest.raises(ValueError, match="weights must match"):
        KeyedJaggedTensor(KEYS, vals, np.ones((len(vals), 2), np.float32), lengths=lens)
    with pytest.raises(ValueError, match="1-D"):
        KeyedJaggedTensor.from_lengths_sync(KEYS, np.zeros((len(vals), 3), np.uint32), lens)


def test_reshaping_keeps_words():
    vals, lens = packed()
    kjt = KeyedJaggedTensor.from_lengths_sync(KEYS, vals, lens, capacities=[4, 8, 4])
    assert_holds(kjt.permute([2, 0]), ["c", "a"])
    parts = kjt.split([1, 2])
    assert_holds(parts[0], ["a"])
    assert_holds(parts[1], ["b", "c"])
    assert_holds(KeyedJaggedTensor.concat(parts))
    assert_holds(KeyedJaggedTensor.from_jt_dict(kjt.to_dict()))
    assert KeyedJaggedTensor.from_jt_dict(kjt.to_dict()).capacity_per_key() == (4, 8, 4)
    empty = KeyedJaggedTensor.empty_like(kjt)
    assert empty.is_wide() and empty.values().shape == (0, 2) and empty.keys() == []
    kjt.validate()
    text = repr(kjt)
    assert str(2**63 - 1) in text and str(2**40) in text and "-1" in text
    assert str(2**40) in repr(kjt["a"])
    # under jit: a pytree like any other
    out = jax.jit(lambda k: k.permute([1, 0, 2]))(kjt)
    assert_holds(out, ["b", "a", "c"])


def test_mixed_representations_concat_to_words():
    vals, lens = packed()
    wide = KeyedJaggedTensor.from_lengths_sync(KEYS, vals, lens)
    narrow = KeyedJaggedTensor.from_lengths_sync(["d"], [4, -3, 6], [1, 0, 2])
    both = KeyedJaggedTensor.concat([wide, narrow])
    assert_holds(both, [*KEYS, "d"])
    assert ids_of(both["d"]) == [[4], [], [-3, 6]]  # sign-extended
    jts = {**wide.to_dict(), "d": narrow["d"]}
    assert ids_of(KeyedJaggedTensor.from_jt_dict(jts)["d"]) == [[4], [], [-3, 6]]


def test_narrow_ids_marks_every_wide_id():
    vals, lens = packed()
    kjt = KeyedJaggedTensor.from_lengths_sync(KEYS, vals, lens)
    narrow = kjt.narrow_ids()
    assert narrow.values().dtype == jnp.int32 and not narrow.is_wide()
    assert narrow.narrow_ids() is narrow
    want = KeyedJaggedTensor.from_lengths_sync(
        KEYS, np.where((vals >= 0) & (vals < 2**31), vals, -1), lens
    )
    np.testing.assert_array_equal(np.asarray(narrow.values()), np.asarray(want.values()))
    np.testing.assert_array_equal(np.asarray(narrow.lengths()), lens)
    traced = jax.jit(lambda k: k.narrow_ids())(kjt)
    np.testing.assert_array_equal(np.asarray(traced.values()), np.asarray(want.values()))


def test_stacked_plain_uint32_pairs_are_not_words():
    """A stacked KJT ``[world, C]`` with ``C == 2`` uint32 ids is plain: words need one
    axis more than the lengths."""
    kjt = KeyedJaggedTensor.from_parts(
        ["a"], jnp.ones((2, 2), jnp.uint32), jnp.ones((2, 1), jnp.int32), capacities=[2], stride=1
    )
    assert not kjt.is_wide() and kjt.narrow_ids() is kjt


def test_jagged_tensor_takes_words():
    jt = JaggedTensor(values=np.asarray([2**40, 3, -1], np.int64), lengths=[1, 2])
    assert jt.values().shape == (3, 2)
    assert ids_of(jt) == [[2**40], [3, -1]]
    assert JaggedTensor(values=np.asarray([2, 3], np.int64), lengths=[2]).values().ndim == 1
