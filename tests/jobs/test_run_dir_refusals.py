"""A refused ``jaxrec-train-dlrm`` command leaves the file system as it found it:
every check that can refuse runs before the job writes anything (``args.json``,
``checkpoints/``, a new ``runs/`` directory, or ``--overwrite``'s clearing)."""

import pathlib

import pytest

from jaxrec.jobs.train_dlrm import main

TINY = ["--num-train", "3072", "--num-eval", "1000", "--batch-size", "128", "--quiet"]


def _tree(root: pathlib.Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in root.rglob("*")
    }


@pytest.fixture
def earlier_run(tmp_path):
    """A run directory as an earlier run left it (a checkpoint step is a numbered folder)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "24").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    (run / "args.json").write_text('{"args": {}}')
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "notes.txt").write_text("mine")
    return run


def _refused(tmp_path, monkeypatch, argv, says):
    monkeypatch.chdir(tmp_path)  # a run without --run-dir would make runs/ here
    before = _tree(tmp_path)
    with pytest.raises(SystemExit, match=says):
        main([*TINY, *argv])
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("exists", [False, True])
def test_resume_without_a_checkpoint(tmp_path, monkeypatch, exists):
    run = tmp_path / "new"
    if exists:
        (run / "notes.txt").parent.mkdir()
        (run / "notes.txt").write_text("mine")
    argv = ["--run-dir", str(run), "--resume"]
    _refused(tmp_path, monkeypatch, argv, "--resume: no checkpoint under")


def test_a_fresh_run_into_a_runs_checkpoints(tmp_path, monkeypatch, earlier_run):
    argv = ["--run-dir", str(earlier_run)]
    _refused(tmp_path, monkeypatch, argv, "already holds checkpoints.*latest step 24")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--resume", "--no-checkpoint"], "drop --no-checkpoint"),
        (["--resume", "--overwrite"], "pass one"),
        # refused after the data is read ...
        (["--overwrite", "--num-train", "100"], "100 training rows: fewer than one global"),
        (["--overwrite", "--cache-tables", "t_nope"], "t_nope"),
        # ... and after the model is built: --overwrite must not have cleared the run yet
        (["--overwrite", "--cache-tables", "t_cat_0", "--pipeline", "sparse-dist"], "use sync"),
    ],
)
def test_bad_flags_with_an_existing_run_dir(tmp_path, monkeypatch, earlier_run, argv, says):
    _refused(tmp_path, monkeypatch, ["--run-dir", str(earlier_run), *argv], says)


def test_bad_flags_without_a_run_dir_make_no_runs_directory(tmp_path, monkeypatch):
    argv = ["--cache-tables", "t_cat_0", "--pipeline", "semi-sync"]
    _refused(tmp_path, monkeypatch, argv, "use sync")
