"""The dry run: ``python -m jaxrec.distributed.planner`` on JSON and CSV specs."""

import json
import pathlib
import subprocess
import sys

import pytest

from jaxrec.distributed import ShardingPlan
from jaxrec.distributed.planner import EmbeddingShardingPlanner, Topology
from jaxrec.distributed.planner.__main__ import main
from jaxrec.distributed.planner.table_specs import load_table_specs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "jaxrec.distributed.planner", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_dry_run_example_json(tmp_path):
    out = tmp_path / "plan.json"
    r = _run("--tables", str(ROOT / "examples/planner_tables.json"), "--plan-out", str(out))
    assert r.returncode == 0, r.stderr
    assert "sharding plan: 26 tables on 8 devices" in r.stdout
    assert "step estimate" in r.stdout and "t_cat_2" in r.stdout
    plan = ShardingPlan.from_json(out.read_text())
    assert set(plan.plan[""]) == {f"t_cat_{i}" for i in range(26)}
    # The same plan in this process: deterministic across processes.
    tables, cons, settings = load_table_specs(ROOT / "examples/planner_tables.json")
    planner = EmbeddingShardingPlanner(
        Topology(**settings["topology"]), cons, optimizer=settings["optimizer"]
    )
    assert planner.plan(tables) == plan


def test_dry_run_csv_and_infeasible(tmp_path, capsys):
    """The same entry point in-process (a subprocess per case costs seconds of imports)."""
    spec = tmp_path / "tables.csv"
    spec.write_text(
        "name,num_embeddings,embedding_dim,feature_names,pooling_factor,sharding_types,hbm_only\n"
        "user,4000000,64,user_id;user_hist,20,table_wise,true\n"
        "item,100000,32,item_id,1,,\n"
    )
    assert main(["--tables", str(spec), "--devices", "4", "--hbm-gib", "64", "--quiet-plan"]) == 0
    assert "user | 4000000 x 64 FP32 | table_wise" in capsys.readouterr().out
    args = ["--tables", str(spec), "--devices", "4", "--hbm-gib", "1", "--optimizer", "adam"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "PlannerError" in err and "user" in err and "allow row_wise" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"name": "x", "num_embeddings": 10}]))
    with pytest.raises(ValueError, match="needs 'embedding_dim'"):
        main(["--tables", str(bad)])
