"""The HTTP prediction server and JSONL batch mode: answers, 4xx on bad requests,
and still answering afterwards."""

import http.client
import json
import re

import numpy as np
import pytest
from export_cases import KEYS, NUM_DENSE, make_batch, make_model

from jaxrec.inference import PredictionServer, export, load, predict_file


@pytest.fixture(scope="module")
def model_and_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "art"
    dense, kjt, _ = make_batch(4)
    export(make_model(), (dense, kjt), path)
    loaded = load(path)
    server = PredictionServer(loaded, port=0, max_instances=8).start()
    yield loaded, server
    server.stop()


def request(server, method, path, body=None, raw=None):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    data = raw if raw is not None else (None if body is None else json.dumps(body))
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def instances(b, seed=0):
    dense, _, raw = make_batch(b, seed)
    return (
        dense,
        raw,
        [{"dense": dense[i].tolist(), "sparse": {k: raw[k][i] for k in KEYS}} for i in range(b)],
    )


def test_health(model_and_server):
    _, server = model_and_server
    status, body = request(server, "GET", "/health")
    assert status == 200 and body["status"] == "ok"
    assert body["manifest"]["features"] == list(KEYS) and "weights" not in body["manifest"]
    assert "integrity" not in body["manifest"]


def test_predict_matches_loaded_model(model_and_server):
    loaded, server = model_and_server
    dense, raw, inst = instances(3)
    status, body = request(server, "POST", "/predict", {"instances": inst})
    assert status == 200
    np.testing.assert_allclose(body["predictions"], loaded(dense, raw)[:, 0], rtol=1e-6)


def _inst(**change):
    return [{"dense": [0.0] * NUM_DENSE, "sparse": {k: [1] for k in KEYS}, **change}]


BAD = {
    "bad_json": (400, "not valid JSON", dict(raw="{nope")),
    "no_instances": (400, "instances", dict(body={"inputs": []})),
    "unknown_feature": (
        400,
        r"unknown feature\(s\) \['zz'\]",
        dict(body={"instances": _inst(sparse={**{k: [1] for k in KEYS}, "zz": [1]})}),
    ),
    "missing_feature": (
        400,
        r"missing feature\(s\) \['f2'\]",
        dict(body={"instances": _inst(sparse={"f0": [1], "f1": [1]})}),
    ),
    "wrong_type": (
        400,
        "ids must be a list of integers, got a string",
        dict(body={"instances": _inst(sparse={"f0": "1", "f1": [1], "f2": [1]})}),
    ),
    "float_ids": (
        400,
        "ids must be integers, got a number 1.5",
        dict(body={"instances": _inst(sparse={"f0": [1.5], "f1": [1], "f2": [1]})}),
    ),
    "too_many_ids": (
        400,
        r"has 5 ids; this artifact allows at most 3 \(max_ids_per_sample\['f1'\]",
        dict(body={"instances": _inst(sparse={"f0": [1], "f1": [1] * 5, "f2": [1]})}),
    ),
    "dense_width": (400, "'dense' has 2 values", dict(body={"instances": _inst(dense=[1, 2])})),
    "too_many_instances": (413, "at most 8", dict(body={"instances": _inst() * 9})),
    "bad_path": (404, "no such path", dict(body={}, path="/nope")),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_requests_get_4xx_and_server_survives(model_and_server, case):
    _, server = model_and_server
    status, match, kw = BAD[case]
    got, body = request(server, "POST", kw.get("path", "/predict"), kw.get("body"), kw.get("raw"))
    assert got == status, body
    assert set(body) == {"error"}
    assert re.search(match, body["error"]), body["error"]
    ok, after = request(server, "POST", "/predict", {"instances": _inst()})
    assert ok == 200 and len(after["predictions"]) == 1


def test_batch_file_mode(model_and_server, tmp_path):
    loaded, _ = model_and_server
    dense, raw, inst = instances(5, seed=3)
    lines = [json.dumps(x) for x in inst]
    lines.insert(2, "{broken")
    lines.insert(4, json.dumps(_inst(sparse={"f0": [1]})[0]))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    stats = predict_file(loaded, tmp_path / "in.jsonl", tmp_path / "out.jsonl", batch_size=3)
    assert stats == {"lines": 7, "errors": 2}
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert "not valid JSON" in out[2]["error"] and "missing feature" in out[4]["error"]
    preds = [o["prediction"] for o in out if "prediction" in o]
    np.testing.assert_allclose(preds, loaded(dense, raw)[:, 0], rtol=1e-6)


def test_serve_example_batch_mode(model_and_server, tmp_path):
    import importlib.util
    import os

    loaded, _ = model_and_server
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "serve.py")
    spec = importlib.util.spec_from_file_location("examples_serve", path)  # not bench/serve.py
    serve_example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_example)
    dense, raw, inst = instances(2, seed=5)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in inst))
    argv = [str(loaded.path), "--input", str(tmp_path / "in.jsonl")]
    assert serve_example.main([*argv, "--output", str(tmp_path / "out.jsonl")]) == 0
    out = [json.loads(x)["prediction"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(out, loaded(dense, raw)[:, 0], rtol=1e-6)
