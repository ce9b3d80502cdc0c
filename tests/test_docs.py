"""The documentation site (docs/, Sphinx + MyST) builds with no warnings and its samples run.

Two builds share one parsed environment: HTML with warnings as errors (broken cross-page
links, docstrings that are not valid reStructuredText, duplicate API entries all fail),
then the doctest builder, which runs every ``{testcode}`` sample and compares its
``{testoutput}``. The README links only to files in the repository, and its sample runs.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]


def _sphinx_build(builder, out, doctrees):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", builder]
    cmd += ["-d", str(doctrees), str(ROOT / "docs"), str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_docs_build_without_warnings_and_samples_run(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    pytest.importorskip("furo")
    doctrees = tmp_path / "doctrees"
    html = _sphinx_build("html", tmp_path / "html", doctrees)
    assert html.returncode == 0, html.stderr[-5000:]
    for page in ["index", "getting-started", "guides/sharding", "api/sparse"]:
        assert (tmp_path / "html" / f"{page}.html").is_file(), page
    # The API reference holds the docstrings, not just the module names.
    api = (tmp_path / "html" / "api" / "sparse.html").read_text()
    assert "KeyedJaggedTensor" in api and "from_lengths_sync" in api

    doctest = _sphinx_build("doctest", tmp_path / "doctest", doctrees)
    report = (tmp_path / "doctest" / "output.txt").read_text()
    assert doctest.returncode == 0, doctest.stderr[-3000:] + report[-3000:]
    ran = int(re.search(r"^\s*(\d+) tests?$", report, re.M).group(1))
    assert ran >= 4, report  # getting started, concepts, training, the mapping
    assert re.search(r"^\s*0 failures in tests$", report, re.M), report


def test_readme_links_stay_inside_the_repository():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 300
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links into docs/"
    for link in local:
        assert (ROOT / link).exists(), link
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        assert "DESIGN.md" not in page.read_text(), page


def test_readme_python_sample_runs():
    text = (ROOT / "README.md").read_text()
    samples = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
    assert samples, "the README shows the mapping in code"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for code in samples:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]


def _page_block_matches(expected, actual):
    """Whether a page's output block is a command's output.

    Lines are compared exactly (trailing spaces aside), in order; a line that is only
    ``...`` stands for any number of lines. Planning time, the one figure that moves
    from run to run, is left out of the comparison.
    """
    timing = re.compile(r"planned in \d+(\.\d+)? s")
    parts = []
    for line in expected.splitlines():
        line = timing.sub("planned in <t> s", line.rstrip())
        parts.append(r"(?:[^\n]*\n)*?" if line.strip() == "..." else re.escape(line) + r"\n")
    lines = [timing.sub("planned in <t> s", line.rstrip()) for line in actual.splitlines()]
    return re.fullmatch("".join(parts), "".join(f"{line}\n" for line in lines)) is not None


def test_planner_dry_run_on_the_page_is_the_commands_output():
    # docs/guides/planner.md shows a dry run as `$ python -m ...` and its output: run
    # that command and compare, so a change to the planner that moves a printed
    # figure fails here until the page is updated.
    page = (ROOT / "docs" / "guides" / "planner.md").read_text()
    dry_run = r"^```\n\$ (python -m jaxrec\.distributed\.planner .*?)\n(.*?)^```"
    blocks = re.findall(dry_run, page, re.M | re.S)
    assert len(blocks) == 1, "the planner guide shows one dry run"
    command, expected = blocks[0]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    argv = [sys.executable, *command.split()[1:]]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _page_block_matches(expected, proc.stdout), (
        f"docs/guides/planner.md's dry run differs from `{command}`; its output now:\n"
        + proc.stdout
    )


def test_page_block_matching():
    out = "a\nplanned in 0.50 s\nb 1\nb 2\nc\n"
    assert _page_block_matches("a\nplanned in 0.17 s\n...\nc\n", out)
    assert _page_block_matches("a\nplanned in 1 s\nb 1\n  ...\nc", out)
    assert not _page_block_matches("a\nplanned in 0.17 s\nb 3\n...\nc\n", out)
    assert not _page_block_matches("x\n...\n", out)
