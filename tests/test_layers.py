"""The one-way layers of docs/architecture.md, checked from the code's own imports.

import-linter (contracts in pyproject.toml) reads every import statement of
every module, those inside functions included, so a circle cannot hide behind
a function-level import. The private-name rule is ours: names starting with
``_`` stay inside their package.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT = [
    sys.executable,
    "-c",
    "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())",
]


def _lint(cwd: pathlib.Path, config: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    args = [*LINT, "--no-cache"] + (["--config", str(config)] if config else [])
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_jaxrec_imports_only_downward_without_circles():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_the_contracts_catch_an_upward_import_inside_a_function(tmp_path):
    # A two-layer package whose lower layer imports the upper one inside a function,
    # and two sibling modules that import each other: both contracts must break.
    pkg = tmp_path / "toy"
    (pkg / "low").mkdir(parents=True)
    (pkg / "high").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "__init__.py").write_text("from ..low import a\n")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from ..high import x  # noqa\n")
    (pkg / "low" / "b.py").write_text("from . import c\n")
    (pkg / "low" / "c.py").write_text("from . import b\n")
    (pkg / "high" / "x.py").write_text("")
    config = tmp_path / "contracts.toml"
    config.write_text(
        textwrap.dedent(
            """
            [tool.importlinter]
            root_package = "toy"
            [[tool.importlinter.contracts]]
            name = "layers"
            type = "layers"
            layers = ["toy.high", "toy.low"]
            [[tool.importlinter.contracts]]
            name = "acyclic"
            type = "acyclic_siblings"
            ancestors = ["toy", "toy.*"]
            """
        )
    )
    result = _lint(tmp_path, config)
    assert result.returncode != 0
    assert "toy.low.a -> toy.high" in result.stdout
    assert "2 broken" in result.stdout


def _private_imports(root: pathlib.Path, package: str) -> list[str]:
    """``file:line name`` for every ``_name`` imported from another top-level package."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = parts[:-1] if parts[-1] == "__init__" else parts
        own = module[1] if len(module) > 1 else None
        here = parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                target = here[: len(here) - (node.level - 1)] + tuple(
                    (node.module or "").split(".")
                )
            else:
                target = tuple((node.module or "").split("."))
            if target[0] != package or len(target) < 2 or target[1] == own:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {alias.name}")
    return found


def test_no_private_name_is_imported_across_packages():
    assert _private_imports(ROOT, "jaxrec") == []


def test_the_private_name_rule_can_fail(tmp_path):
    (tmp_path / "toy" / "a").mkdir(parents=True)
    (tmp_path / "toy" / "b").mkdir()
    (tmp_path / "toy" / "a" / "m.py").write_text("from ..b.n import _hidden, shown\n")
    (tmp_path / "toy" / "b" / "n.py").write_text("from . import _own_package_is_fine\n")
    assert _private_imports(tmp_path, "toy") == ["toy/a/m.py:1 _hidden"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
