"""bench/sharded.py at a tiny size: runs, and its layout-predicted bytes equal the HLO's."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import sharded  # noqa: E402


def test_tiny_run_predicts_the_compiled_collectives(capsys):
    argv = ["--E", "200", "--B", "8", "--T", "2", "--reps", "1", "--no-unsharded",
            "--types", "row_wise,column_wise,data_parallel"]  # fmt: skip
    assert sharded.main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["impl"] for x in lines] == ["row_wise", "column_wise", "data_parallel"]
    for x in lines:
        assert x["comm_plan"]["kinds"] == x["comm_hlo"]["kinds"], x["impl"]
        assert x["median_ms"] > 0 and x["world"] == 8
    assert lines[1]["comm_plan"]["stages"]["row_sum_all_reduce"] == 4 * 2 * 200
