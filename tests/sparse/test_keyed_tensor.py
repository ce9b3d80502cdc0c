import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrec import KeyedTensor


def test_keyed_tensor_basics_and_repr():
    kt = KeyedTensor(keys=["x", "y"], length_per_key=[2, 3], values=jnp.arange(10.0).reshape(2, 5))
    assert kt.keys() == ["x", "y"] and kt.length_per_key() == [2, 3]
    assert kt.offset_per_key() == [0, 2, 5] and kt.key_dim() == 1
    assert kt["y"].tolist() == [[2.0, 3.0, 4.0], [7.0, 8.0, 9.0]]
    assert repr(kt) == (
        'KeyedTensor({\n    "x": [[0.0, 1.0], [5.0, 6.0]],\n'
        '    "y": [[2.0, 3.0, 4.0], [7.0, 8.0, 9.0]]\n})\n'
    )
    assert jax.jit(lambda k: k["x"].sum())(kt) == 12.0


def test_regroup_against_numpy():
    rng = np.random.default_rng(0)
    a_vals, b_vals = rng.normal(size=(4, 5)), rng.normal(size=(4, 4))
    a = KeyedTensor(["a1", "a2"], [2, 3], jnp.asarray(a_vals))
    b = KeyedTensor(["b1"], [4], jnp.asarray(b_vals))
    g1, g2 = KeyedTensor.regroup([a, b], [["b1", "a1"], ["a2"]])
    np.testing.assert_allclose(g1, np.concatenate([b_vals, a_vals[:, :2]], axis=1), rtol=1e-6)
    np.testing.assert_allclose(g2, a_vals[:, 2:], rtol=1e-6)
    d = KeyedTensor.regroup_as_dict([a, b], [["a2"], ["b1"]], ["first", "second"])
    assert list(d) == ["first", "second"] and d["second"].shape == (4, 4)
    with pytest.raises(KeyError, match="in none of"):
        KeyedTensor.regroup([a], [["zz"]])


def test_from_tensor_list_and_key_dim0():
    kt = KeyedTensor.from_tensor_list(["p", "q"], [jnp.ones((2, 3)), jnp.zeros((2, 1))])
    assert kt.values().shape == (2, 4) and kt.length_per_key() == [3, 1]
    kt0 = KeyedTensor(["p", "q"], [1, 2], jnp.arange(6).reshape(3, 2), key_dim=0)
    assert kt0["q"].tolist() == [[2, 3], [4, 5]]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((["a"], [1, 2], jnp.ones((2, 3))), "1 keys but 2"),
        ((["a", "a"], [1, 2], jnp.ones((2, 3))), "duplicate"),
        ((["a"], [2], jnp.ones((2, 3))), "sum\\(length_per_key\\)"),
    ],
)
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        KeyedTensor(*args)
