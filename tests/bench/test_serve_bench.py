"""bench/serve.py, tiny: every client setting reports, no request fails."""

import json

import pytest

pytest.importorskip("flatbuffers")  # jax.export serialization needs it

import serve


def test_serve_bench_tiny(capsys):
    argv = ["--requests", "12", "--clients", "1,3", "--instances", "3", "--T", "2", "--E", "50"]
    assert serve.main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["clients"] for r in lines] == [1, 3]
    for r in lines:
        assert r["requests"] == 12 and r["errors"] == 0
        assert r["requests_per_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert r["compiled_batch_sizes"] == [4]
