"""Fuzzing the server's request decoding: for any body (random JSON with wrong types,
nesting, huge numbers, NaN/Infinity literals, missing/extra keys, ragged lists, or
random bytes) ``decode_request`` returns the batch a plain-Python reference decoding
gives, or raises the server's 4xx error; never another exception. A few bodies also
go end to end through the HTTP server."""

import http.client
import json
import math
import struct
import types

import chex
import hypothesis.strategies as st
import numpy as np
import pytest
from export_cases import KEYS, MAX_IDS, NUM_DENSE, ROWS, make_batch
from hypothesis import HealthCheck, given, settings

from jaxrec.inference import PredictionServer, load
from jaxrec.inference.request import (
    MAX_JSON_DEPTH,
    RequestError,
    batch_arrays,
    decode_request,
)

MAX_INSTANCES = 4


def stub(weighted):
    return types.SimpleNamespace(
        features=KEYS,
        num_dense=NUM_DENSE,
        dense_dtype=np.dtype(np.float32),
        max_ids=(MAX_IDS,) * len(KEYS),
        num_embeddings=ROWS,
        weighted=weighted,
        starts=np.arange(len(KEYS) + 1) * MAX_IDS,
    )


# ----- the reference: plain Python, rule by rule -----
class Bad(Exception):
    def __init__(self, status=400):
        self.status = status


def _f32(x):
    """``x`` rounded to float32 (struct raises OverflowError past float32's range)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise Bad
    try:
        y = struct.unpack("<f", struct.pack("<f", float(x)))[0]
    except OverflowError:
        raise Bad from None
    if not math.isfinite(y):
        raise Bad
    return y


def _depth(x):
    if isinstance(x, list):
        return 1 + max((_depth(v) for v in x), default=0)
    if isinstance(x, dict):
        return 1 + max((_depth(v) for v in x.values()), default=0)
    return 0


def _no_constant(name):
    raise Bad


def reference(weighted, raw: bytes):
    """``(dense rows, sparse, weights)`` or raises Bad(status)."""
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise Bad from None
    if _depth(doc) > MAX_JSON_DEPTH:
        raise Bad
    if not isinstance(doc, dict) or set(doc) != {"instances"}:
        raise Bad
    insts = doc["instances"]
    if not isinstance(insts, list) or not insts:
        raise Bad
    if len(insts) > MAX_INSTANCES:
        raise Bad(413)
    fields = {"dense", "sparse", "weights"} if weighted else {"dense", "sparse"}
    dense, sparse = [], {k: [] for k in KEYS}
    weights = {k: [] for k in KEYS} if weighted else None
    for inst in insts:
        if not isinstance(inst, dict) or not set(inst) <= fields or not fields <= set(inst):
            raise Bad
        d = inst["dense"]
        if not isinstance(d, list) or len(d) != NUM_DENSE:
            raise Bad
        dense.append([_f32(x) for x in d])
        s = inst["sparse"]
        if not isinstance(s, dict) or set(s) != set(KEYS):
            raise Bad
        for key, rows in zip(KEYS, ROWS, strict=True):
            ids = s[key]
            if not isinstance(ids, list) or len(ids) > MAX_IDS:
                raise Bad
            for v in ids:
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < rows:
                    raise Bad
            sparse[key].append(list(ids))
        if weighted:
            w = inst["weights"]
            if not isinstance(w, dict) or set(w) != set(KEYS):
                raise Bad
            for key in KEYS:
                wk = w[key]
                if not isinstance(wk, list) or len(wk) != len(sparse[key][-1]):
                    raise Bad
                weights[key].append([_f32(x) for x in wk])
    return dense, sparse, weights


# ----- strategies -----
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**40), 10**40),
    st.floats(allow_nan=True, allow_infinity=True),  # dumped as NaN/Infinity literals
    st.floats(min_value=-1e6, max_value=1e6),
    st.text(max_size=4),
)
any_json = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)


finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
SPECIAL = [1e39, -1e39, 3.4028235e38, 3.4028236e38, 10**400, -(2**63), 2**64, 1.0, 0.5, -1, True]
SPECIAL += [float("nan"), float("inf"), -float("inf"), None, "1", [], {}]


@st.composite
def valid_instance(draw, weighted):
    sparse = {
        k: draw(st.lists(st.integers(0, rows - 1), max_size=MAX_IDS))
        for k, rows in zip(KEYS, ROWS, strict=True)
    }
    inst = {"dense": draw(st.lists(finite, min_size=NUM_DENSE, max_size=NUM_DENSE))}
    inst["sparse"] = sparse
    if weighted:
        inst["weights"] = {
            k: draw(st.lists(finite, min_size=len(v), max_size=len(v))) for k, v in sparse.items()
        }
    return inst


def _slots(x, out):
    """Every (container, key) in ``x``, depth first."""
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        out.append((x, k))
        _slots(v, out)
    return out


@st.composite
def mutate(draw, doc):
    """One change to ``doc``: a value replaced (special numbers, anything), a key
    dropped or added, a list made ragged."""
    slots = _slots(doc, [(None, None)])
    parent, key = draw(st.sampled_from(slots))
    op = draw(st.sampled_from(["special", "any", "drop", "add"]))
    if parent is None:
        return draw(any_json) if op == "any" else doc
    if op == "special":
        parent[key] = draw(st.sampled_from(SPECIAL))
    elif op == "any":
        parent[key] = draw(any_json)
    elif op == "drop":
        del parent[key]
    elif isinstance(parent, dict):
        parent[draw(st.text(max_size=3) | st.sampled_from(["weights", "label", "f9"]))] = 1
    else:
        parent.append(draw(st.sampled_from(SPECIAL) | st.integers(0, 3)))
    return doc


@st.composite
def body(draw, weighted):
    kind = draw(st.integers(0, 11))
    if kind == 0:
        return draw(st.binary(max_size=40))
    if kind == 1:  # brackets, also inside strings (which do not nest)
        n = draw(st.integers(MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH + 3))
        inner = draw(st.sampled_from(["", '"[[[{"', "1", '{"a": 1}']))
        return ("[" * n + inner + "]" * n).encode()
    if kind == 2:
        return json.dumps(draw(any_json)).encode()
    n = draw(st.integers(1, MAX_INSTANCES + 1 if kind == 3 else MAX_INSTANCES))
    doc = {"instances": [draw(valid_instance(weighted)) for _ in range(n)]}
    for _ in range(draw(st.integers(0, 2)) if kind > 5 else 0):  # about half stay valid
        doc = draw(mutate(doc))
    text = json.dumps(doc)
    if kind == 4:  # a number beyond Python's int-literal digit limit
        text = text.replace("0", "9" * 5000, 1)
    return text.encode()


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_decode_matches_reference_or_raises_4xx(weighted, data):
    raw = data.draw(body(weighted))
    model = stub(weighted)
    try:
        want = reference(weighted, raw)
    except Bad as e:
        with pytest.raises(RequestError) as info:
            decode_request(model, raw, max_instances=MAX_INSTANCES)
        assert info.value.status == e.status, str(info.value)
        return
    got = decode_request(model, raw, max_instances=MAX_INSTANCES)
    dense, sparse, weights = want
    assert got.dense.dtype == np.float32 and got.dense.shape == (len(dense), NUM_DENSE)
    np.testing.assert_array_equal(got.dense, np.asarray(dense, np.float32).reshape(-1, NUM_DENSE))
    assert got.sparse == sparse
    assert got.weights == weights
    check_arrays(model, got, sparse, weights)


def check_arrays(model, got, sparse, weights):
    """``batch_arrays`` (what the server runs) against the per-sample layout built by hand."""
    arrays = batch_arrays(model, got)
    b = got.dense.shape[0]
    values = np.zeros((b, MAX_IDS * len(KEYS)), np.int32)
    lengths = np.zeros((b, len(KEYS)), np.int32)
    wts = np.zeros(values.shape, np.float32)
    for k, key in enumerate(KEYS):
        for i in range(b):
            ids = sparse[key][i]
            values[i, k * MAX_IDS : k * MAX_IDS + len(ids)] = ids
            lengths[i, k] = len(ids)
            if weights is not None:
                wts[i, k * MAX_IDS : k * MAX_IDS + len(ids)] = weights[key][i]
    want = (got.dense, values, lengths) + ((wts,) if weights is not None else ())
    chex.assert_trees_all_equal(tuple(arrays), want, strict=True)  # count, dtypes, values


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_valid_batch_decodes_like_the_reference(weighted):
    dense, _, raw = make_batch(MAX_INSTANCES, seed=3)
    insts = [{"dense": dense[i].tolist(), "sparse": {k: raw[k][i] for k in KEYS}} for i in range(4)]
    if weighted:
        for inst in insts:
            inst["weights"] = {k: [0.5] * len(v) for k, v in inst["sparse"].items()}
    body = json.dumps({"instances": insts}).encode()
    got = decode_request(stub(weighted), body, max_instances=MAX_INSTANCES)
    want_dense, want_sparse, want_weights = reference(weighted, body)
    np.testing.assert_array_equal(got.dense, dense)
    np.testing.assert_array_equal(got.dense, np.asarray(want_dense, np.float32))
    assert got.sparse == want_sparse == raw and got.weights == want_weights
    check_arrays(stub(weighted), got, raw, want_weights)


@pytest.fixture(scope="module")
def server(dlrm_artifact):
    srv = PredictionServer(load(dlrm_artifact), port=0, max_instances=MAX_INSTANCES).start()
    yield srv
    srv.stop()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=body(False))
def test_end_to_end_status_matches_reference(server, raw):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    conn.request("POST", "/predict", body=raw)
    resp = conn.getresponse()
    payload = json.loads(resp.read())  # always JSON, and standard (no NaN)
    conn.close()
    try:
        dense, _, _ = reference(False, raw)
    except Bad as e:
        assert resp.status == e.status and set(payload) == {"error"}, payload
        return
    assert resp.status == 200, payload
    assert len(payload["predictions"]) == len(dense)
    assert all(math.isfinite(p) for p in payload["predictions"])
