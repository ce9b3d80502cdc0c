"""The quantized-lookup benchmark's tiny preset, run as a smoke and correctness test."""

import dataclasses
import json

import pytest
import quant_lookup
from specs import PRESETS


def test_one_line_per_dtype_within_bound(capsys):
    argv = ["--preset", "tiny", "--reps", "2", "--warmup", "1", "--qdtypes", "int4,fp16"]
    assert quant_lookup.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["qdtype"] for r in lines] == ["fp32", "int4", "fp16"]
    spec = PRESETS["tiny"]
    assert lines[0]["table_bytes"] == spec.T * spec.E * spec.D * 4
    for r in lines[1:]:
        assert r["within_bound"] and r["speedup_vs_fp32"] > 0
        assert r["bench"] == "quant_lookup" and r["min_ms"] <= r["median_ms"]
    ratios = {r["qdtype"]: r["table_bytes_ratio_vs_fp32"] for r in lines[1:]}
    assert ratios == {"int4": 0.25, "fp16": 0.5}  # D=16: rows of 16 and 32 bytes


def test_bad_arguments():
    with pytest.raises(ValueError, match="qdtypes"):
        quant_lookup.run(PRESETS["tiny"], ("int3",))
    with pytest.raises(ValueError, match="float32"):
        quant_lookup.run(dataclasses.replace(PRESETS["tiny"], dtype="fp16"))
