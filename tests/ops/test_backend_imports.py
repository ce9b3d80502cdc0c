"""The kernels layer imports one way: ``jaxrec.ops`` imports its backends, never back.

Every import statement of the backends (``jaxrec.pallas``, ``jaxrec.cpu``) and of
the shared XLA path (``jaxrec.xla``) is read from the source, function-level ones
included, and resolved to a jaxrec package.
"""

import ast
import pathlib

import pytest

import jaxrec

ROOT = pathlib.Path(jaxrec.__file__).parent
LEAVES = {"configs", "optim", "sparse"}
ALLOWED = {
    "pallas": LEAVES | {"xla", "pallas"},
    "cpu": LEAVES | {"xla", "cpu"},
    "xla": LEAVES | {"xla"},
}


def _jaxrec_imports(path: pathlib.Path) -> set[tuple[str, int]]:
    """``(package, line)`` of every jaxrec package ``path`` imports."""
    package = path.relative_to(ROOT.parent).with_suffix("").parts[:-1]  # ("jaxrec", "cpu")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join((*base, node.module) if node.module else base)
            names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "jaxrec" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_backends_and_xla_import_nothing_above_them(layer):
    files = sorted((ROOT / layer).glob("*.py"))
    assert files
    wrong = [
        f"{path.relative_to(ROOT.parent)}:{line} imports jaxrec.{pkg}"
        for path in files
        for pkg, line in sorted(_jaxrec_imports(path))
        if pkg.removesuffix(".py") not in ALLOWED[layer]
    ]
    assert not wrong, wrong
