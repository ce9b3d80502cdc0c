"""bench/gpu_check.sh, the one command for a GPU machine: starts, fails cleanly without one."""

import os
import subprocess
from pathlib import Path

import jax
import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "gpu_check.sh"


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU is present: the script would run")
def test_without_a_gpu_exits_2_and_writes_nothing(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "GPU_CHECK_OUT": str(tmp_path / "out")}
    done = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs a GPU backend" in done.stderr and "'cpu'" in done.stderr
    assert not (tmp_path / "out").exists()


def test_every_step_names_an_existing_file():
    """The steps' scripts and test files exist (a renamed file would fail only on the GPU)."""
    text = SCRIPT.read_text()
    root = SCRIPT.parents[1]
    named = [w for w in text.split() if w.startswith(("tests/", "bench/")) and w.endswith(".py")]
    assert len(named) >= 5
    missing = [n for n in named if not (root / n).exists()]
    assert not missing, missing


def test_benchmark_steps_parse_their_arguments(monkeypatch):
    """Each ``python bench/<x>.py <args>`` step's arguments parse (no GPU needed)."""
    import importlib
    import re
    import shlex
    import sys

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    text = SCRIPT.read_text().replace("\\\n", " ")  # continued lines joined
    steps = re.findall(r"python bench/(\w+)\.py ([^\n]*)", text)
    assert len(steps) >= 5
    for module, args in steps:
        mod = importlib.import_module(module)
        monkeypatch.setattr(sys, "argv", [module])
        assert mod.parse_args(shlex.split(args)) is not None


def test_step_limits_fit_the_device_budget():
    """The steps' time limits sum to at most 570 s, under the 600 s a run may take (the
    device is lent for 15 minutes, start-up included); each step is named once."""
    import re

    text = SCRIPT.read_text().replace("\\\n", " ")
    steps = re.findall(r"^step (\w+) (\d+) ", text, flags=re.M)
    names = [n for n, _ in steps]
    expected = {"tests", "lookup_target", "lookup_hbm", "init_rows", "train_step", "cache"}
    assert expected <= set(names)
    assert len(names) == len(set(names))
    total = sum(int(limit) for _, limit in steps)
    assert total <= 570, dict(steps)
