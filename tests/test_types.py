"""pyright (basic mode, ``[tool.pyright]`` in pyproject.toml) reports no error in jaxrec/,
every file of it (the config excludes nothing)."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("pyright") is None, reason="pyright (test extra) not installed")
@pytest.mark.skipif(
    shutil.which("node") is None, reason="no node on PATH (pyright's package would download one)"
)
def test_jaxrec_type_checks():
    result = subprocess.run(
        ["pyright", "--outputjson"], cwd=ROOT, capture_output=True, text=True, timeout=1200
    )
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:  # pyright did not run (no report): say why
        pytest.fail(f"pyright exited {result.returncode}:\n{result.stderr[-3000:]}")
    errors = [
        f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}"
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    ]
    assert not errors, "\n".join(errors[:50])
    files = len(list((ROOT / "jaxrec").rglob("*.py")))
    assert report["summary"]["filesAnalyzed"] >= files  # every module, none excluded
