"""``jaxrec-train-dlrm``'s entry point: ``--help`` and bad flags answer before JAX loads,
and a bad flag gets a two-line message naming it."""

import os
import pathlib
import subprocess
import sys

import pytest

from jaxrec.jobs.dlrm_flags import parse_args

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The console script's path through the code: the command line's flags, then exit.
PROBE = """
import atexit, sys
atexit.register(lambda: print(sorted(m for m in ("jax", "flax", "numpy") if m in sys.modules)))
sys.argv = ["jaxrec-train-dlrm", *sys.argv[1:]]
from jaxrec.jobs.dlrm_cli import main
main()
"""


def _entry(*argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", PROBE, *argv], env=env, capture_output=True, text=True, timeout=60
    )


def test_help_loads_no_jax():
    result = _entry("--help")
    assert result.returncode == 0, result.stderr
    assert "--batch-size" in result.stdout
    assert result.stdout.rstrip().endswith("[]")  # no jax, flax or numpy imported


def test_a_bad_flag_fails_before_jax_loads():
    result = _entry("--batch-size", "many")
    assert result.returncode == 2
    assert result.stdout.strip() == "[]"
    assert result.stderr.splitlines() == [
        "jaxrec-train-dlrm: error: argument --batch-size: invalid int value: 'many'",
        "jaxrec-train-dlrm: see --help for every flag",
    ]


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--model", "dlrmm"], ["--model", "'dlrmm'"]),
        (["--epochs"], ["--epochs"]),
        (["--batch-sise", "64"], ["--batch-sise", "did you mean --batch-size?"]),
        (["--max-stepz=5"], ["--max-stepz=5", "did you mean --max-steps?"]),
    ],
)
def test_an_error_is_two_lines_naming_the_flag(argv, names, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "usage" not in lines[0]
    assert all(name in lines[0] for name in names), lines
    assert lines[1] == "jaxrec-train-dlrm: see --help for every flag"
