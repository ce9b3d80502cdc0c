"""bench/build_compile.py on a tiny configuration: every field present, figures sane."""

import json

import build_compile


def test_tiny_build_compile_run(capsys, tmp_path):
    out = tmp_path / "build.jsonl"
    argv = [
        "--tables",
        "6",
        "--total-rows",
        "3000",
        "--min-rows",
        "10",
        "--max-rows",
        "1000",
        "--dims",
        "8,4",
        "--dtypes",
        "fp32,bf16",
        "--plans",
        "table_wise",
        "--reps",
        "2",
        "--batch",
        "4",
        "--ids-per-sample",
        "12",
        "--out",
        str(out),
    ]
    assert build_compile.main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [json.loads(x) for x in out.read_text().splitlines()] == lines
    (r,) = lines
    assert r["plan"] == "table_wise" and r["tables"] == 6 and r["groups"] == 4
    tables = build_compile.make_tables(
        6, dims=[8, 4], dtypes=["fp32", "bf16"], min_rows=10, max_rows=1000, total_rows=3000
    )
    assert r["table_bytes"] == build_compile.table_bytes(tables)
    assert {t.data_type.value for t in tables} == {"FP32", "BF16"}
    for k in ("draw_gbps", "numpy_gbps", "sharded_build_s", "compile_s", "step_ms"):
        assert r[k] > 0, (k, r)
    assert r["cpu"] and r["overflow"] == "exact"
