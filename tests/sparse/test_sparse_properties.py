"""Property tests of the sparse builders against a plain-Python model of ragged data.

The model is ``{key: [bag, ...]}`` with each bag a list of ids (and, when
weighted, a parallel list of weights). Valid inputs must round-trip through
every builder and reshaping op; invalid ones must raise ``ValueError`` or
``TypeError`` (never another exception, never a silent result).
"""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import jaxrec as jr

# Small: every new shape compiles the eager ops once (~0.1 s each on a busy 2-core box).
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ["a", "b", "c", "d", "e"]


@st.composite
def ragged(draw, weighted=None):
    """``(keys, bags, weights)``: ``bags[k][b]`` a list of ids; weights parallel or None."""
    n_keys = draw(st.integers(0, 3))
    keys = draw(st.permutations(NAMES))[:n_keys]
    stride = draw(st.integers(0, 3))
    bag = st.lists(st.integers(0, 2**31 - 1), max_size=3)
    bags = [[draw(bag) for _ in range(stride)] for _ in keys]
    weighted = draw(st.booleans()) if weighted is None else weighted
    weights = None
    if weighted:
        finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)
        weights = [[[draw(finite) for _ in b] for b in key] for key in bags]
    return keys, bags, weights


def packed(bags, weights):
    values = [i for key in bags for b in key for i in b]
    lengths = [len(b) for key in bags for b in key]
    w = None if weights is None else [x for key in weights for b in key for x in b]
    return (
        np.asarray(values, np.int64),
        np.asarray(lengths, np.int32),
        None if w is None else np.asarray(w, np.float32),
    )


def as_model(kjt):
    """The plain-Python model of a KeyedJaggedTensor: ``(keys, bags, weights)``."""
    bags, weights = [], []
    for jt in kjt.to_dict().values():
        bags.append([b.tolist() for b in jt.to_dense()])
        w = jt.to_dense_weights()
        weights.append(None if w is None else [x.tolist() for x in w])
    has_w = kjt.weights_or_none() is not None
    return kjt.keys(), bags, (weights if has_w else None)


def expect(kjt, keys, bags, weights, stride):
    assert kjt.keys() == list(keys) and kjt.stride() == stride
    got_keys, got_bags, got_w = as_model(kjt)
    assert got_bags == bags
    if weights is None:
        assert got_w is None
    else:
        np.testing.assert_array_equal(
            np.asarray([x for k in got_w for b in k for x in b], np.float32),
            np.asarray([x for k in weights for b in k for x in b], np.float32),
        )
    np.testing.assert_array_equal(kjt.lengths(), [len(b) for key in bags for b in key])
    caps = kjt.capacity_per_key()
    assert all(sum(map(len, key)) <= c for key, c in zip(bags, caps, strict=True))
    # segment ids address the capacity layout: position -> k * B + b, padding F * B
    seg = np.asarray(kjt.segment_ids())
    want = np.full(sum(caps), len(keys) * stride)
    start = 0
    for k, key in enumerate(bags):
        pos = start
        for b, ids in enumerate(key):
            want[pos : pos + len(ids)] = k * stride + b
            pos += len(ids)
        start += caps[k]
    np.testing.assert_array_equal(seg, want)


@SETTINGS
@given(ragged(), st.booleans())
def test_from_lengths_and_offsets_round_trip(data, explicit_caps):
    keys, bags, weights = data
    stride = len(bags[0]) if bags else 0
    values, lengths, w = packed(bags, weights)
    caps = [sum(map(len, key)) + 3 for key in bags] if explicit_caps else None
    kjt = jr.KeyedJaggedTensor.from_lengths_sync(
        keys, values, lengths, w, stride=stride, capacities=caps
    )
    expect(kjt, keys, bags, weights, stride)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    kjt = jr.KeyedJaggedTensor.from_offsets_sync(keys, values, offsets, w, stride=stride)
    expect(kjt, keys, bags, weights, stride)


@SETTINGS
@given(ragged())
def test_from_jt_dict_and_from_dense_round_trip(data):
    keys, bags, weights = data
    stride = len(bags[0]) if bags else 0
    jts = {}
    for k, key in enumerate(bags):
        w = None if weights is None else weights[k]
        jt = jr.JaggedTensor.from_dense([np.asarray(b, np.int32) for b in key], weights=w)
        assert [x.tolist() for x in jt.to_dense()] == key
        n = max(map(len, key), default=0)
        dense = np.asarray(jt.to_padded_dense(desired_length=n, padding_value=-1))
        assert dense.tolist() == [b + [-1] * (n - len(b)) for b in key]
        jts[keys[k]] = jt
    if not keys:
        return
    kjt = jr.KeyedJaggedTensor.from_jt_dict(jts)
    expect(kjt, keys, bags, weights, stride)


@SETTINGS
@given(ragged(), st.data())
def test_permute_split_concat(data, draw):
    keys, bags, weights = data
    stride = len(bags[0]) if bags else 0
    values, lengths, w = packed(bags, weights)
    kjt = jr.KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, w, stride=stride)
    order = draw.draw(st.permutations(range(len(keys))))
    keep = order[: draw.draw(st.integers(0, len(keys)))]
    perm = kjt.permute(keep)
    sub_w = None if weights is None else [weights[i] for i in keep]
    if keep:
        expect(perm, [keys[i] for i in keep], [bags[i] for i in keep], sub_w, stride)
    else:
        assert perm.keys() == []
    sizes, left = [], len(keys)
    while left:
        n = draw.draw(st.integers(0, left))
        sizes.append(n)
        left -= n
    parts = kjt.split(sizes)
    assert [p.keys() for p in parts] == [
        list(keys[sum(sizes[:i]) : sum(sizes[: i + 1])]) for i in range(len(sizes))
    ]
    if keys:
        expect(jr.KeyedJaggedTensor.concat(parts), keys, bags, weights, stride)
    d = kjt.to_dict()
    assert list(d) == list(keys)
    for k, key in zip(keys, bags, strict=True):
        assert [b.tolist() for b in d[k].to_dense()] == key


# ----- invalid inputs -----
def _builders(keys, values, lengths, weights, stride):
    """``(name, build)`` for every host builder of packed (TorchRec-style) inputs."""
    yield (
        "from_lengths_sync",
        lambda: jr.KeyedJaggedTensor.from_lengths_sync(
            keys, values, lengths, weights, stride=stride
        ),
    )
    yield (
        "KeyedJaggedTensor",
        lambda: jr.KeyedJaggedTensor(keys, values, weights, lengths=lengths, stride=stride),
    )
    if np.issubdtype(np.asarray(lengths).dtype, np.integer):
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        yield (
            "from_offsets_sync",
            lambda: jr.KeyedJaggedTensor.from_offsets_sync(
                keys, values, offsets, weights, stride=stride
            ),
        )
    if len(keys) == 1:
        yield "JaggedTensor", lambda: jr.JaggedTensor(values, weights, lengths=lengths)


# Defects a builder legitimately accepts: the capacity layout (KeyedJaggedTensor,
# JaggedTensor) allows trailing padding; a JaggedTensor has no stride and may
# hold float or [C, D] embeddings.
ACCEPTED = {
    ("too_few", "KeyedJaggedTensor"),
    ("too_few", "JaggedTensor"),
    ("float_values", "JaggedTensor"),
    ("stride", "JaggedTensor"),
    ("2d_values", "JaggedTensor"),
}


@st.composite
def broken(draw):
    """A valid packed batch with one defect; ``(keys, values, lengths, weights, stride)``."""
    keys, bags, weights = draw(ragged(weighted=True).filter(lambda r: r[0] and r[1][0]))
    stride = len(bags[0])
    values, lengths, w = packed(bags, weights)
    values, lengths, w = values.astype(np.int32), lengths.copy(), w.copy()
    defect = draw(
        st.sampled_from(
            [
                "negative",
                "too_many",
                "too_few",
                "float_values",
                "float_lengths",
                "weights_nan",
                "weights_inf",
                "weights_int_array",
                "weights_shape",
                "stride",
                "bool_values",
                "2d_values",
            ]
        )
    )
    i = draw(st.integers(0, len(lengths) - 1))
    if defect == "negative":
        lengths[i] = -draw(st.integers(1, 5))
    elif defect == "too_many":  # lengths ask for more values than there are
        lengths[i] += draw(st.integers(1, 3))
    elif defect == "too_few":  # values left over
        values = np.concatenate([values, np.zeros(draw(st.integers(1, 3)), values.dtype)])
        w = np.concatenate([w, np.ones(values.size - w.size, np.float32)])
    elif defect == "float_values":
        values = values.astype(np.float32)
    elif defect == "float_lengths":
        lengths = lengths.astype(np.float64) + 0.5
    elif defect in ("weights_nan", "weights_inf"):
        if w.size == 0:
            lengths[i] = -1
        else:
            w[draw(st.integers(0, w.size - 1))] = np.nan if defect == "weights_nan" else -np.inf
    elif defect == "weights_int_array":
        w = w.astype(np.int32)
    elif defect == "weights_shape":
        w = np.concatenate([w, [1.0]]).astype(np.float32)
    elif defect == "stride":
        stride += draw(st.integers(1, 3))
    elif defect == "bool_values":
        values = values > 0
    elif defect == "2d_values":
        values = values.reshape(1, -1)
    return defect, keys, values, lengths, w, stride


@SETTINGS
@given(broken())
def test_invalid_inputs_raise_value_or_type_error(case):
    defect, keys, values, lengths, w, stride = case
    for name, build in _builders(keys, values, lengths, w, stride):
        if (defect, name) in ACCEPTED:
            continue
        with pytest.raises((ValueError, TypeError)):
            build()
            pytest.fail(f"{name} accepted {defect}")


@SETTINGS
@given(st.lists(st.integers(-3, 5), min_size=1, max_size=6), st.integers(0, 12))
def test_jagged_tensor_value_checks(lengths, capacity):
    values = np.zeros(capacity, np.int32)
    ok = min(lengths) >= 0 and sum(lengths) <= capacity
    if ok:
        jt = jr.JaggedTensor(values, lengths=lengths)
        assert jt.lengths().tolist() == lengths and jt.capacity() == capacity
    else:
        with pytest.raises(ValueError):
            jr.JaggedTensor(values, lengths=lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    if min(lengths) < 0:
        with pytest.raises(ValueError):
            jr.JaggedTensor(values, offsets=offsets)
