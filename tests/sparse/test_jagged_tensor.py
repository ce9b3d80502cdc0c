import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrec import JaggedTensor


def test_tutorial_jagged_tensor():
    # TorchRec intro: lengths [1, 2], values [5, 7, 1].
    jt = JaggedTensor(values=[5, 7, 1], lengths=[1, 2])
    assert jt.offsets().tolist() == [0, 1, 3]
    assert [x.tolist() for x in jt.to_dense()] == [[5], [7, 1]]
    assert repr(jt) == "JaggedTensor({\n    [[5], [7, 1]]\n})\n"


def test_offsets_constructor_and_accessors():
    jt = JaggedTensor(values=np.array([1, 2, 3, 0]), offsets=[0, 2, 2, 3])
    assert jt.lengths().tolist() == [2, 0, 1]
    assert jt.lengths_or_none() is jt.lengths()
    assert jt.offsets_or_none().tolist() == [0, 2, 2, 3]
    assert jt.weights_or_none() is None
    with pytest.raises(ValueError, match="no weights"):
        jt.weights()
    assert jt.capacity() == 4 and jt.num_bags() == 3
    assert jt.valid_mask().tolist() == [True, True, True, False]
    assert jt.segment_ids().tolist() == [0, 0, 2, 3]  # padding -> B


def test_weighted_repr_matches_torchrec_format():
    jt = JaggedTensor(values=[5, 7, 1], lengths=[1, 2], weights=[0.5, 1.0, 2.0])
    assert repr(jt) == (
        'JaggedTensor({\n    "values": [[5], [7, 1]],\n    "weights": [[0.5], [1.0, 2.0]]\n})\n'
    )


@pytest.mark.parametrize("desired", [None, 2, 5])
def test_to_padded_dense(desired):
    bags = [[4, 5, 6], [], [7]]
    jt = JaggedTensor.from_dense(bags, weights=[[1.0, 2.0, 3.0], [], [4.0]])
    n = desired if desired is not None else 3
    expect = np.full((3, n), -1)
    for b, ids in enumerate(bags):
        ids = ids[:n]
        expect[b, : len(ids)] = ids
    np.testing.assert_array_equal(jt.to_padded_dense(desired, padding_value=-1), expect)
    w = jt.to_padded_dense_weights(desired)
    assert w.shape == (3, n) and float(w[0, 0]) == 1.0


def test_to_padded_dense_jit_needs_length():
    jt = JaggedTensor(values=[1, 2], lengths=[2])
    assert jax.jit(lambda j: j.to_padded_dense(3))(jt).tolist() == [[1, 2, 0]]
    with pytest.raises(TypeError, match="concrete"):
        jax.jit(lambda j: j.to_padded_dense())(jt)


def test_from_dense_buckets_capacity_and_pads_with_zero():
    jt = JaggedTensor.from_dense([[5], [7, 1]])
    assert jt.capacity() == 8
    assert jt.values().tolist() == [5, 7, 1, 0, 0, 0, 0, 0]
    assert JaggedTensor.from_dense([[5]], capacity=1).capacity() == 1
    with pytest.raises(ValueError, match="capacity"):
        JaggedTensor.from_dense([[5, 6]], capacity=1)


def test_from_dense_lengths_in_jit():
    dense = jnp.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    jt = jax.jit(JaggedTensor.from_dense_lengths)(dense, jnp.array([1, 0, 2]))
    assert [x.tolist() for x in jt.to_dense()] == [[1], [], [7, 8]]


def test_pytree_roundtrip_and_jit():
    jt = JaggedTensor(values=[5, 7, 1], lengths=[1, 2], weights=[1.0, 2.0, 3.0])
    leaves, treedef = jax.tree.flatten(jt)
    assert len(leaves) == 3
    back = jax.tree.unflatten(treedef, leaves)
    assert back.values() is leaves[0]
    total = jax.jit(lambda j: jnp.sum(j.values() * j.weights()))(jt)
    assert float(total) == 5 + 14 + 3


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"values": [1, 2], "lengths": [1, 2]}, ValueError, "exceeds the capacity"),
        ({"values": [1, 2], "lengths": [-1, 2]}, ValueError, "non-negative"),
        ({"values": [1, 2], "lengths": [1.0, 1.0]}, TypeError, "integer dtype"),
        ({"values": [1, 2], "lengths": [1, 1], "weights": [1.0]}, ValueError, "weights must match"),
        ({"values": [1, 2]}, ValueError, "lengths or offsets"),
        ({"values": [1, 2], "offsets": [1, 2]}, ValueError, "start at 0"),
        ({"values": [1, 2], "offsets": [0, 2, 1]}, ValueError, "non-decreasing"),
        ({"values": [1], "lengths": np.array([2**40])}, ValueError, "int32 range"),
    ],
)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        JaggedTensor(**kwargs)


def test_device_arrays_validate_only_on_request():
    values, lengths = jnp.array([1, 2]), jnp.array([3])
    JaggedTensor(values=values, lengths=lengths)  # no host sync by default
    with pytest.raises(ValueError, match="exceeds"):
        JaggedTensor(values=values, lengths=lengths, validate=True)


def test_from_parts_takes_leaves_as_they_are():
    # an EmbeddingCollection output: float [C, D] embeddings, the ids in the weights slot
    emb, lengths, ids = jnp.ones((3, 4)), jnp.array([1, 2]), jnp.array([5, 7, 1])
    jt = JaggedTensor.from_parts(emb, lengths, ids)
    assert jt.values() is emb and jt.lengths() is lengths and jt.weights() is ids
    assert JaggedTensor.from_parts(emb, lengths).weights_or_none() is None
    jaxpr = jax.make_jaxpr(lambda v, n: JaggedTensor.from_parts(v, n).values())(emb, lengths)
    assert jaxpr.eqns == []  # free under jit: no conversion, no check
