import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy_reference import packed

from jaxrec import JaggedTensor, KeyedJaggedTensor


def tutorial_kjt():
    product = JaggedTensor(values=[1, 2, 3, 1, 5, 7, 9], lengths=[3, 4])
    user = JaggedTensor(values=[2, 3, 4, 1], lengths=[2, 2])
    return KeyedJaggedTensor.from_jt_dict({"product": product, "user": user})


def test_tutorial_kjt():
    kjt = tutorial_kjt()
    assert kjt.keys() == ["product", "user"]
    assert kjt.lengths().tolist() == [3, 4, 2, 2]
    assert kjt.values().tolist() == [1, 2, 3, 1, 5, 7, 9, 2, 3, 4, 1]
    assert kjt.offsets().tolist() == [0, 3, 7, 9, 11]  # tutorial Q2
    assert kjt.stride() == 2
    d = kjt.to_dict()
    assert list(d) == ["product", "user"]
    assert [x.tolist() for x in d["user"].to_dense()] == [[2, 3], [4, 1]]
    assert repr(kjt) == (
        "KeyedJaggedTensor({\n"
        '    "product": [[1, 2, 3], [1, 5, 7, 9]],\n'
        '    "user": [[2, 3], [4, 1]]\n'
        "})\n"
    )


def test_torchrec_doc_example_offsets():
    # torchrec.modules EBC docstring: f1 [[0, 1], [], [2]], f2 [[3], [4], [5, 6, 7]].
    kjt = KeyedJaggedTensor(keys=["f1", "f2"], values=list(range(8)), offsets=[0, 2, 2, 3, 4, 5, 8])
    assert kjt.stride() == 3
    assert kjt.capacity_per_key() == (3, 5)
    assert kjt.length_per_key().tolist() == [3, 5]
    assert kjt.offset_per_key().tolist() == [0, 3, 8]
    assert [x.tolist() for x in kjt["f1"].to_dense()] == [[0, 1], [], [2]]
    assert kjt.segment_ids().tolist() == [0, 0, 2, 3, 4, 5, 5, 5]


def test_from_lengths_sync_buckets_and_pads():
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], [1, 2, 3], [1, 0, 2, 0])
    assert kjt.capacity_per_key() == (8, 8)
    assert kjt.capacity_offsets() == (0, 8, 16)
    assert kjt.values()[:1].tolist() == [1] and kjt.values()[8:10].tolist() == [2, 3]
    assert kjt.lengths().tolist() == [1, 0, 2, 0]
    # padding positions map to the out-of-range segment F * B
    seg = kjt.segment_ids()
    assert seg[0] == 0 and seg[8] == 2 and seg[9] == 2
    assert all(s == 4 for i, s in enumerate(seg.tolist()) if i not in (0, 8, 9))


def test_from_offsets_sync_with_weights_and_explicit_capacities():
    kjt = KeyedJaggedTensor.from_offsets_sync(
        ["a", "b"], [1, 2, 3], [0, 1, 1, 3, 3], weights=[0.5, 1.5, 2.5], capacities={"a": 2, "b": 3}
    )
    assert kjt.capacity_per_key() == (2, 3)
    assert kjt["b"].weights()[:2].tolist() == [1.5, 2.5]
    assert '"weights": [[0.5], []]' in repr(kjt)
    with pytest.raises(ValueError, match="key 'b' has 2 values but its capacity is 1"):
        KeyedJaggedTensor.from_offsets_sync(
            ["a", "b"], [1, 2, 3], [0, 1, 1, 3, 3], capacities=[2, 1]
        )


def test_random_roundtrip_against_lists():
    rng = np.random.default_rng(0)
    keys = ["x", "y", "z"]
    bags = [[rng.integers(0, 50, rng.integers(0, 4)).tolist() for _ in range(5)] for _ in keys]
    values, lengths = packed(bags)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
    for k, key in enumerate(keys):
        assert [x.tolist() for x in kjt[key].to_dense()] == bags[k]
    assert kjt.lengths().tolist() == lengths.tolist()
    assert kjt.offsets().tolist() == [0, *np.cumsum(lengths).tolist()]


def test_permute_split_concat():
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b", "c"], [1, 2, 3, 4], [1, 0, 1, 1, 0, 1], weights=[1.0, 2.0, 3.0, 4.0]
    )
    p = kjt.permute([2, 0])
    assert p.keys() == ["c", "a"]
    assert [x.tolist() for x in p["c"].to_dense()] == [[], [4]]
    assert p.lengths().tolist() == [0, 1, 1, 0]
    parts = kjt.split([1, 2])
    assert [x.keys() for x in parts] == [["a"], ["b", "c"]]
    back = KeyedJaggedTensor.concat(parts)
    assert back.keys() == kjt.keys()
    np.testing.assert_array_equal(back.values(), kjt.values())
    np.testing.assert_array_equal(back.weights(), kjt.weights())
    with pytest.raises(ValueError, match="duplicate keys"):
        KeyedJaggedTensor.concat([parts[0], parts[0]])
    with pytest.raises(ValueError, match="sum to 3"):
        kjt.split([1, 1])
    with pytest.raises(ValueError, match="out of range"):
        kjt.permute([3])


def test_empty_and_empty_like():
    kjt = tutorial_kjt()
    e = KeyedJaggedTensor.empty_like(kjt)
    assert e.keys() == [] and e.stride() == 2 and e.values().shape == (0,)
    assert repr(KeyedJaggedTensor.empty(is_weighted=True)) == "KeyedJaggedTensor()\n"
    assert KeyedJaggedTensor.empty(is_weighted=True).weights().shape == (0,)


def test_pytree_static_metadata_and_jit():
    kjt = tutorial_kjt()
    leaves, treedef = jax.tree.flatten(kjt)
    assert len(leaves) == 2  # values, lengths (no weights)
    out = jax.jit(lambda k: k["user"].values().sum() + k.stride())(kjt)
    assert int(out) == 10 + 2
    traced = jax.jit(lambda k: jnp.asarray(len(repr(k))))
    assert int(traced(kjt)) > 0  # repr of a traced KJT does not pull values


def test_constructor_under_jit_needs_capacities():
    def build(values, lengths):
        return KeyedJaggedTensor(["a", "b"], values, lengths=lengths)

    with pytest.raises(ValueError, match="capacities="):
        jax.jit(build)(jnp.arange(4), jnp.array([1, 1, 1, 1]))

    def build_caps(values, lengths):
        return KeyedJaggedTensor(
            ["a", "b"], values, lengths=lengths, capacities=(2, 2)
        ).segment_ids()

    assert jax.jit(build_caps)(jnp.arange(4), jnp.array([1, 1, 0, 1])).tolist() == [0, 1, 3, 4]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"keys": ["a", "a"], "values": [1], "lengths": [1, 0]}, ValueError, "duplicate keys"),
        ({"keys": "a", "values": [1], "lengths": [1]}, TypeError, "single string"),
        ({"keys": [1], "values": [1], "lengths": [1]}, TypeError, "keys must be str"),
        ({"keys": ["a"], "values": [1.5], "lengths": [1]}, TypeError, "integer dtype"),
        ({"keys": ["a"], "values": [1], "lengths": [-1, 2]}, ValueError, "non-negative"),
        ({"keys": ["a"], "values": [1], "lengths": [2]}, ValueError, "exceeds the capacity"),
        ({"keys": ["a", "b"], "values": [1], "lengths": [1, 0, 0]}, ValueError, "key-major"),
        ({"keys": ["a"], "values": [1], "lengths": [1], "stride": 2}, ValueError, "stride 2"),
        (
            {"keys": ["a"], "values": [1, 2], "lengths": [1], "weights": [1.0]},
            ValueError,
            "weights must match",
        ),
        (
            {"keys": ["a", "b"], "values": [1, 2], "lengths": [1, 1], "capacities": (1, 2)},
            ValueError,
            "sum\\(capacities\\)",
        ),
        (
            {"keys": ["a", "b"], "values": [1, 2, 3], "lengths": [2, 1], "capacities": (1, 2)},
            ValueError,
            "key 'a' has 2 values but its capacity is 1",
        ),
    ],
)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        KeyedJaggedTensor(**kwargs)


def test_from_jt_dict_errors():
    a = JaggedTensor(values=[1], lengths=[1])
    b = JaggedTensor(values=[1, 2], lengths=[1, 1])
    with pytest.raises(ValueError, match="same batch size"):
        KeyedJaggedTensor.from_jt_dict({"a": a, "b": b})
    w = JaggedTensor(values=[1], lengths=[1], weights=[1.0])
    with pytest.raises(ValueError, match="every JaggedTensor has weights"):
        KeyedJaggedTensor.from_jt_dict({"a": a, "w": w})
    with pytest.raises(KeyError, match="not a key"):
        KeyedJaggedTensor.from_jt_dict({"a": a})["b"]


def test_from_lengths_sync_on_host_keeps_numpy_leaves_equal_to_device_build():
    keys, vals, lens = ["a", "b"], np.arange(5, dtype=np.int64), [2, 0, 1, 2]
    w = np.linspace(0.5, 1.0, 5)
    host = KeyedJaggedTensor.from_lengths_sync(keys, vals, lens, w, on_host=True)
    dev = KeyedJaggedTensor.from_lengths_sync(keys, vals, lens, w)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
    assert host.values().dtype == np.int32 and host.lengths().dtype == np.int32
    assert host.capacity_per_key() == dev.capacity_per_key()
    chex.assert_trees_all_equal(host, dev, strict=True)  # structure, dtypes, values
    with pytest.raises(ValueError, match="non-negative"):
        KeyedJaggedTensor.from_lengths_sync(keys, vals, [2, -1, 1, 3], on_host=True)


def test_from_parts_takes_leaves_as_they_are():
    kjt = tutorial_kjt()
    w = jnp.linspace(0.5, 1.0, 11)
    built = KeyedJaggedTensor.from_parts(
        ["product", "user"],
        kjt.values(),
        kjt.lengths(),
        w,
        capacities=kjt.capacity_per_key(),
        stride=kjt.stride(),
    )
    assert built.values() is kjt.values() and built.lengths() is kjt.lengths()
    assert built.weights() is w
    same = KeyedJaggedTensor(
        ["product", "user"], kjt.values(), w, kjt.lengths(), capacities=kjt.capacity_per_key()
    )
    assert jax.tree.structure(built) == jax.tree.structure(same)  # keys, capacities, stride
    assert [x.tolist() for x in built["user"].to_dense()] == [[2, 3], [4, 1]]
    # leading dims (as inside shard_map or vmap) are kept: no shape checks on the leaves
    stacked = KeyedJaggedTensor.from_parts(
        ["a"], jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 3), jnp.int32), capacities=[4], stride=3
    )
    assert stacked.values().shape == (2, 4) and stacked.weights_or_none() is None


def test_from_parts_is_free_under_jit():
    # no conversion, no value check: the traced program holds no operation, and bad
    # lengths are not inspected (validate() is the opt-in check)
    def build(values, lengths):
        kjt = KeyedJaggedTensor.from_parts(["a", "b"], values, lengths, capacities=(2, 2), stride=2)
        return kjt.values(), kjt.lengths()

    jaxpr = jax.make_jaxpr(build)(jnp.arange(4), jnp.array([1, 1, 5, -1]))
    assert jaxpr.eqns == []
    values, lengths = jnp.arange(2), jnp.array([3])
    with jax.transfer_guard("disallow"):  # no device-to-host copy
        kjt = KeyedJaggedTensor.from_parts(["a"], values, lengths, capacities=(2,), stride=1)
    with pytest.raises(ValueError, match="exceeds the capacity"):
        kjt.validate()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keys": ["a", "a"], "capacities": (1, 1), "stride": 1}, "duplicate keys"),
        ({"keys": ["a", "b"], "capacities": (2,), "stride": 1}, "one capacity per key"),
        ({"keys": ["a"], "capacities": (2,), "stride": -1}, "stride"),
        ({"keys": ["a"], "capacities": (-2,), "stride": 1}, "capacities"),
    ],
)
def test_from_parts_checks_its_static_layout(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        KeyedJaggedTensor.from_parts(values=jnp.arange(2), lengths=jnp.array([1]), **kwargs)
