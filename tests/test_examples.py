import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]
# Every runnable example (synthetic_clicks.py is the model examples' shared data).
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if p.name != "synthetic_clicks.py")
NO_OPTIONS = {"intro.py"}  # --help shows usage, but no option has a default to show

# One process runs every example's `--help` (JAX is imported once, not once per
# example): each must leave with SystemExit(0) from argparse. An example that
# ignored --help would run its whole job and return normally, which is reported.
HELP_DRIVER = """
import contextlib, io, json, runpy, sys
sys.path.insert(0, sys.argv[1])  # the model examples import synthetic_clicks
for path in sys.argv[2:]:
    sys.argv, out, code = [path, "--help"], io.StringIO(), "ran without exiting"
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code
    print(json.dumps({"path": path, "code": code, "help": out.getvalue()}))
"""


def test_every_example_answers_help_at_once_with_defaults():
    proc = subprocess.run(
        [sys.executable, "-c", HELP_DRIVER, str(ROOT / "examples"), *map(str, EXAMPLES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {pathlib.Path(r["path"]).name: r for r in map(json.loads, proc.stdout.splitlines())}
    assert sorted(results) == [p.name for p in EXAMPLES]
    for name, r in results.items():
        assert r["code"] in (0, None), f"{name}: {r['code']}"
        assert r["help"].startswith("usage:"), f"{name}: {r['help'][:200]!r}"
        assert name in NO_OPTIONS or "(default:" in r["help"], f"{name} shows no defaults"
    job = " ".join(results["train_dlrm.py"]["help"].split())  # the job's own formatter:
    assert "(default: None)" not in job and "(default: False)" not in job  # "not given"
    assert "--seed SEED data, initialisation, shuffling (default: 0)" in job  # 0 is shown


def test_intro_example_prints_the_tutorial_numbers():
    out = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "examples" / "intro.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "[[0.6299 0.5843 0.4988 0.6115]]" in out  # EmbeddingBag mean over ids [1, 3]
    assert "Lengths:  [3 4 2 2]" in out and "(2, 128)" in out


def test_sharded_train_example_runs():
    out = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "examples" / "sharded_train.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "ShardedEmbeddingBagCollection" in out and "row_wise" in out


def test_cached_train_example_runs():
    """A small run: the cache warms (hits), and the restored all-device model predicts
    what the cached one does (the example exits 1 otherwise)."""
    out = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            str(ROOT / "examples" / "cached_train.py"),
            "--rows",
            "20000",
            "--steps",
            "5",
            "--batch-size",
            "128",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "predictions equal: True" in out and "hit rate 0." in out
