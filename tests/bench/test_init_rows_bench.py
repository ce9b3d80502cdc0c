"""bench/init_rows.py on a small buffer: one record per dim, every rate positive."""

import json

import init_rows


def test_small_init_rows_run(capsys):
    assert init_rows.main(["--dims", "4", "16", "--mb", "4", "--reps", "2", "--xla"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["dim"] for r in lines] == [4, 16]
    for r in lines:
        for k in ("draw_gbs", "copy_gbs", "numpy_gbs", "xla_gbs"):
            assert r[k] > 0, (k, r)
        assert r["cpu"] and r["platform"] == "cpu"
