"""The main job (`jaxrec-train-dlrm`): outputs, evaluation over every sample, exact resume."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from numpy_reference import rank_auc
from tensorboard_events import read_scalars

from jaxrec.checkpoint import CheckpointWarning
from jaxrec.cpu import hugepages
from jaxrec.jobs import dlrm_parts, run_dir
from jaxrec.jobs.train_dlrm import main, parse_config

TINY = ["--num-train", "3072", "--num-eval", "1000", "--batch-size", "128"]


def _run(tmp_path, name, *extra, quiet=True):
    run_dir = tmp_path / name
    quiet = ["--quiet"] if quiet else []
    assert main([*TINY, *quiet, "--run-dir", str(run_dir), *extra]) == 0
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def _reference_metrics(eval_step, state, data):
    """AUC and NE of the whole eval set as one batch, with numpy."""
    (batch,) = data.batches(len(data), shuffle=False, drop_last=False)
    p = np.asarray(eval_step(state, jax.device_put(batch)), np.float64)
    y = np.asarray(batch.labels, np.float64)
    ce = -np.mean(y * np.log2(p) + (1 - y) * np.log2(1 - p))
    ctr = y.mean()
    base = -(ctr * np.log2(ctr) + (1 - ctr) * np.log2(1 - ctr))
    return {"auc": rank_auc(y, p), "ne": ce / base, "ctr": ctr}


@pytest.mark.parametrize("devices", [1, 8])
def test_evaluate_covers_every_sample(devices):
    # 1000 eval samples are not a multiple of the global batch: the padded tail
    # (weight 0) must count its real rows once and its padding never.
    config = parse_config([*TINY, "--devices", str(devices)])
    train, evals = dlrm_parts.load_data(config)
    model = dlrm_parts.build_model(config, train)
    ref_graphdef, ref_state, _, ref_eval = dlrm_parts.make_steps(
        model, dlrm_parts.build_optimizer(config), config
    )
    want = _reference_metrics(ref_eval, ref_state, evals)
    mesh, model, _ = dlrm_parts.shard(config, dlrm_parts.build_model(config, train))
    _, state, _, eval_step = dlrm_parts.make_steps(
        model, dlrm_parts.build_optimizer(config), config
    )
    got = dlrm_parts.evaluate(eval_step, state, evals, config, mesh)
    np.testing.assert_allclose(got["auc"], want["auc"], atol=2e-5)
    np.testing.assert_allclose(got["ne"], want["ne"], rtol=2e-4)
    np.testing.assert_allclose(got["ctr"], want["ctr"], rtol=1e-6)


def test_run_writes_summary_metrics_tensorboard_and_plot(tmp_path, capsys):
    run_dir, summary = _run(tmp_path, "a", "--epochs", "2", "--tensorboard", "--plot")
    assert summary["steps"] == 2 * (3072 // 128) and summary["samples"] == 2 * 3072
    assert summary["samples_per_s"] > 0 and 0.5 < summary["eval"]["auc"] <= 1
    assert 0.5 < summary["oracle_auc"] <= 1  # the planted model's own AUC
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [24, 48]  # one evaluation per epoch
    assert {"auc", "ne", "logloss", "calibration", "ctr"} <= set(lines[-1])
    scalars = read_scalars(run_dir / "tb")
    assert [s for s, tag, _ in scalars if tag == "eval/auc"] == [24, 48]
    assert [v for s, tag, v in scalars if tag == "eval/auc"][-1] == pytest.approx(
        summary["eval"]["auc"], rel=1e-6
    )  # float32 in the event file
    assert [s for s, tag, _ in scalars if tag == "train/loss"] == [48]  # every 50 steps, the end
    assert (run_dir / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()] == ["48"]
    with pytest.raises(SystemExit, match="--resume"):  # never overwrite a run by accident
        main([*TINY, "--run-dir", str(run_dir)])
    # --resume on the finished run trains nothing and keeps its summary (eval block included).
    capsys.readouterr()
    kept = (run_dir / "summary.json").read_text()
    assert main([*TINY, "--quiet", "--run-dir", str(run_dir), "--epochs", "2", "--resume"]) == 0
    assert (run_dir / "summary.json").read_text() == kept
    assert json.loads(capsys.readouterr().out) == summary


def test_command_line_run_restarts_with_huge_pages(tmp_path):
    """From the command line the job restarts once with glibc.malloc.hugetlb=1 (its
    large buffers on huge pages from the first touch); main(argv) from Python does not."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    want = hugepages.huge_page_env(env) is not None  # glibc, THP not [never]
    cmd = [
        sys.executable,
        "-m",
        "jaxrec.jobs.dlrm_cli",
        *TINY,
        "--max-steps",
        "2",
        "--no-checkpoint",
        "--quiet",
        "--run-dir",
        str(tmp_path / "cli"),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["huge_pages"] is want
    _, inside = _run(tmp_path, "inside", "--max-steps", "1", "--no-checkpoint")
    assert inside["huge_pages"] is hugepages.started_with_huge_pages()


def test_fresh_run_directory_per_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clock = 1_800_000_000.0
    first = run_dir.new_run_dir(now=clock)
    names = [run_dir.new_run_dir(now=clock).name for _ in range(10)]  # the same second
    assert names == [f"{first.name}-{i}" for i in range(2, 12)]
    assert first.parent == pathlib.Path("runs")
    with pytest.raises(SystemExit, match=rf"--resume needs --run-dir.*--run-dir runs/{names[-1]}"):
        main([*TINY, "--resume"])
    with pytest.raises(SystemExit, match="--overwrite needs --run-dir"):
        main([*TINY, "--overwrite"])


def test_overwrite_removes_only_the_jobs_outputs(tmp_path):
    for name in ("checkpoints/48", "tb"):
        (tmp_path / name).mkdir(parents=True)
    for name in ("summary.json", "metrics.jsonl", "curves.png", "notes.txt"):
        (tmp_path / name).write_text("x")
    run_dir.clear_outputs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dataset", "criteo"], "needs --data-dir .*Criteo 1TB Click Logs"),
        (["--dataset", "criteo", "--data-dir", "nowhere"], "not a directory; Criteo's click logs"),
        (["--dataset", "movielens", "--data-dir", "."], "no MovieLens files in"),
    ],
)
def test_missing_data_is_one_line_with_where_to_get_it(flags, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=message) as e:
        main(flags)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "runs").exists()  # a run that cannot start leaves no directory


def test_resume_continues_exactly(tmp_path):
    """A crash left the newest checkpoint (step 30) damaged: --resume warns, starts
    from step 20 and ends exactly where an uninterrupted run does."""
    _, whole = _run(tmp_path, "whole", "--epochs", "2", "--no-checkpoint")
    cut, part = _run(
        tmp_path, "cut", "--epochs", "2", "--max-steps", "30", "--checkpoint-every", "10"
    )
    assert part["steps"] == 30
    chunk = sorted((cut / "checkpoints" / "30" / "tables").glob("0/weight/*/c/*/*"))[0]
    with open(chunk, "r+b") as f:  # one flipped bit
        f.seek(5)
        byte = f.read(1)[0]
        f.seek(5)
        f.write(bytes([byte ^ 1]))
    with pytest.warns(CheckpointWarning, match="skipping damaged checkpoint step 30"):
        _, resumed = _run(tmp_path, "cut", "--epochs", "2", "--resume")
    assert (
        resumed["steps"] == whole["steps"] and resumed["samples"] == whole["steps"] * 128 - 20 * 128
    )
    for key in ("auc", "ne", "logloss", "calibration"):
        assert resumed["eval"][key] == whole["eval"][key], key


def test_sharded_run_matches_unsharded(tmp_path, capsys):
    # Same global batch (8 x 16 = 128): the planner's plan changes only the
    # order of float sums, so the metrics agree closely.
    _, one = _run(tmp_path, "one", "--no-checkpoint")
    args = ["--no-checkpoint", "--devices", "8", "--batch-size", "16"]
    capsys.readouterr()
    _, eight = _run(tmp_path, "eight", *args, quiet=False)
    err = capsys.readouterr().err.splitlines()  # not a terminal: plain lines
    head = next(i for i, line in enumerate(err) if line.split() == ["table", "sharding", "ranks"])
    plan = [line.split() for line in err[head + 1 : head + 27]]  # the 26 tables, planned
    assert [t for t, _, _ in plan] == [f"t_cat_{i}" for i in range(26)], plan
    steps = [ln for ln in err if ln.startswith("step ") and "eta" in ln]
    assert steps[-1].startswith("step 24/24") and "samples/s" in steps[-1]
    assert eight["devices"] == 8 and eight["steps"] == one["steps"]
    assert abs(eight["eval"]["auc"] - one["eval"]["auc"]) < 1e-3
    assert abs(eight["eval"]["ne"] - one["eval"]["ne"]) < 1e-3


def _criteo_tsv(path, n, seed=0):
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        ints = [str(x) if x >= 0 else "" for x in rng.integers(-1, 50, 13)]
        cats = [f"{x:08x}" if x else "" for x in rng.integers(0, 1 << 32, 26)]
        lines.append("\t".join([str(rng.integers(0, 2)), *ints, *cats]))
    path.write_text("\n".join(lines) + "\n")


def test_criteo_tsv_multi_hot_run(tmp_path, monkeypatch):
    # Kaggle layout (one train.txt: the last 1/7 evaluates), MLPerf multi-hot bags.
    data = tmp_path / "criteo"
    data.mkdir()
    _criteo_tsv(data / "train.txt", 700)
    flags = ["--dataset", "criteo", "--data-dir", str(data), "--num-embeddings", "500"]
    monkeypatch.chdir(tmp_path)  # no --run-dir: a new runs/dlrm-<date>-<time>
    assert main([*flags, "--quiet", "--multi-hot", "mlperf", "--batch-size", "64"]) == 0
    (run,) = pathlib.Path("runs").iterdir()
    assert run.name.startswith("dlrm-")
    summary = json.loads((run / "summary.json").read_text())
    assert json.loads((run / "args.json").read_text())["args"]["run_dir"] == str(run)
    assert summary["steps"] == 600 // 64 and "oracle_auc" not in summary
    assert 0 <= summary["eval"]["auc"] <= 1 and summary["eval"]["ctr"] > 0


def test_semi_sync_pipeline_run(tmp_path):
    """``--pipeline semi-sync`` trains every batch (the drain included) and learns; it
    refuses dynamic tables (ids admitted in the forward) before reading any data."""
    _, summary = _run(tmp_path, "semi", "--pipeline", "semi-sync", "--no-checkpoint")
    assert summary["steps"] == 3072 // 128
    assert summary["eval"]["auc"] > 0.6
    with pytest.raises(SystemExit, match="semi-sync does not take --dynamic-tables"):
        main(
            [
                *TINY,
                "--pipeline",
                "semi-sync",
                "--dynamic-tables",
                "4096",
                "--run-dir",
                str(tmp_path / "d"),
            ]
        )


def test_grad_accumulation_run_equals_the_full_batch_run(tmp_path):
    """``--grad-accumulation 2 --batch-size 64``: each step trains two consecutive
    micro-batches of 64 rows (the rows one batch of 128 holds) with one update, so the
    run follows ``--batch-size 128``'s: same steps, samples and eval metrics (float
    tolerance). Flags it cannot take are refused before any data is read."""
    _, full = _run(tmp_path, "full", "--max-steps", "6", "--no-checkpoint")
    _, acc = _run(
        tmp_path,
        "acc",
        *["--batch-size", "64", "--grad-accumulation", "2", "--max-steps", "6"],
        "--no-checkpoint",
    )
    assert acc["steps"] == full["steps"] == 6 and acc["samples"] == full["samples"]
    for name in ("auc", "ne", "logloss"):
        np.testing.assert_allclose(acc["eval"][name], full["eval"][name], rtol=1e-4)
    for bad, says in (
        (["--pipeline", "semi-sync"], "with --pipeline sync only"),
        (["--dynamic-tables", "4096"], "does not take --dynamic-tables"),
        (["--cache-tables", "t_cat_0"], "does not take cached tables"),
    ):
        with pytest.raises(SystemExit, match=says):
            main([*TINY, "--grad-accumulation", "2", *bad, "--run-dir", str(tmp_path / "x")])
