"""Where a run writes: a fresh directory per run unless ``--run-dir`` names one.

Each run without ``--run-dir`` gets its own ``runs/dlrm-<date>-<time>``, so
commands run one after another never refuse each other. ``--resume`` needs the
run it continues named (resuming "the newest" would pick up another command's
run by surprise); ``--overwrite`` starts a named run directory again.
"""

from __future__ import annotations

import itertools
import re
import shutil
import time
from pathlib import Path

RUNS = Path("runs")
# What the job writes into a run directory: all that --overwrite removes (never
# anything else, in case --run-dir names a folder that holds other files).
OUTPUTS = ("checkpoints", "tb", "metrics.jsonl", "summary.json", "args.json", "curves.png")


def new_run_dir(root: Path = RUNS, prefix: str = "dlrm", now: float | None = None) -> Path:
    """Creates and returns ``root/prefix-YYYYmmdd-HHMMSS`` (``-2``, ``-3``, ... if taken).

    ``mkdir`` claims the name, so two runs started in the same second get two
    directories.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    root.mkdir(parents=True, exist_ok=True)
    names = itertools.chain(
        [f"{prefix}-{stamp}"], (f"{prefix}-{stamp}-{i}" for i in itertools.count(2))
    )
    for name in names:
        try:
            (root / name).mkdir()
            return root / name
        except FileExistsError:
            continue
    raise AssertionError("unreachable: the names never run out")


def newest_run(root: Path = RUNS, prefix: str = "dlrm") -> Path | None:
    """The newest directory :func:`new_run_dir` made in ``root``, by its name, if any."""
    named = re.compile(rf"{re.escape(prefix)}-(\d{{8}}-\d{{6}})(?:-(\d+))?")
    runs = {}
    for path in root.glob(f"{prefix}-*"):
        m = named.fullmatch(path.name)
        if m and path.is_dir():
            runs[(m[1], int(m[2] or 1))] = path
    return runs[max(runs)] if runs else None


def resume_needs_run_dir() -> str:
    """The error for ``--resume`` without ``--run-dir``, naming the newest run if any."""
    newest = newest_run()
    hint = f" (the newest here: --run-dir {newest})" if newest else ""
    return f"--resume needs --run-dir, the run to continue{hint}"


def clear_outputs(run_dir: Path) -> None:
    """Removes what an earlier run wrote into ``run_dir`` (``--overwrite``)."""
    for name in OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
