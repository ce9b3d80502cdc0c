"""What a training job leaves in its run directory: TensorBoard scalars and a PNG plot.

Both go through optional, well-kept libraries: ``tensorboardX`` (the
``tensorboard`` extra) writes the event files and ``matplotlib`` (the
``plots`` extra) draws ``curves.png``. Without them the job still runs and
says once what it skipped (:func:`missing`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

# The metric names the job records and how the plot titles their axes.
LABELS = {
    "train_loss": "train loss (BCE, mean of 50 steps)",
    "eval_auc": "eval AUC",
    "eval_ne": "eval NE (normalized entropy)",
}


def missing(module: str, extra: str, flag: str) -> str | None:
    """``None`` if ``module`` imports, else the one line that says what ``flag`` skips."""
    if importlib.util.find_spec(module) is not None:
        return None
    return f"{flag}: {module} is not installed (pip install 'jaxrec[{extra}]'); skipped"


class ScalarWriter:
    """TensorBoard scalars in ``log_dir`` (``tensorboard --logdir``), via tensorboardX."""

    def __init__(self, log_dir: str | os.PathLike):
        from tensorboardX import SummaryWriter  # optional: the tensorboard extra

        self._writer = SummaryWriter(str(log_dir))

    def add_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, float(value), int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def plot_curves(
    series: Mapping[str, Sequence[tuple[float, float]]], title: str, path: str | os.PathLike
) -> Path:
    """One panel per non-empty series (``name -> [(step, value), ...]``), as a PNG.

    Every point gets a marker, so a single evaluation shows as a dot.
    """
    import matplotlib  # optional: the plots extra

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    series = {k: v for k, v in series.items() if v}
    if not series:
        raise ValueError("plot_curves: every series is empty; nothing to plot")
    fig, axes = plt.subplots(
        len(series), 1, figsize=(6.4, 2.4 * len(series)), sharex=True, squeeze=False
    )
    for ax, (name, points) in zip(axes[:, 0], series.items(), strict=True):
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, marker="o", markersize=4)
        ax.set_ylabel(LABELS.get(name, name))
        ax.grid(alpha=0.3)
        if len(points) == 1:  # the value itself: a lone dot has no visible scale
            ax.annotate(
                f"{values[0]:.4f}", (steps[0], values[0]), textcoords="offset points", xytext=(6, 6)
            )
    axes[-1, 0].set_xlabel("training step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
