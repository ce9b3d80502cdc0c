"""Run-directory outputs and what the job prints: TensorBoard events read back with
tensorboardX's own protocol buffers, the PNG plot, the progress lines, the plan table."""

import io

import numpy as np
from PIL import Image
from tensorboard_events import read_scalars

from jaxrec.jobs.progress import Progress, plan_table
from jaxrec.jobs.run_log import ScalarWriter, missing, plot_curves


def test_scalars_read_back(tmp_path):
    w = ScalarWriter(tmp_path)
    w.add_scalars({"train/loss": 0.5, "eval/auc": 0.75}, step=3)
    w.add_scalars({"train/loss": 0.25}, step=2**40)  # int64 steps
    w.close()
    got = read_scalars(tmp_path)
    assert got == [(3, "train/loss", 0.5), (3, "eval/auc", 0.75), (2**40, "train/loss", 0.25)]


def test_plot_is_a_png_with_every_point(tmp_path):
    path = plot_curves(
        {"train_loss": [(50, 0.7), (100, 0.6)], "eval_auc": [(100, 0.71)], "eval_ne": []},
        "dlrm on synthetic",
        tmp_path / "curves.png",
    )
    image = np.asarray(Image.open(path).convert("RGB"))
    assert image.shape == (480, 640, 3)  # two panels (the empty series is left out), 100 dpi
    # The lone evaluation is a marker: matplotlib's default blue appears in the lower panel.
    blue = np.all(np.abs(image.astype(int) - (31, 119, 180)) < 30, axis=-1)
    assert blue[240:].sum() > 20 and blue[:240].sum() > 20


def test_missing_library_names_the_extra():
    assert missing("json", "plots", "--plot") is None
    why = missing("no_such_module", "plots", "--plot")
    assert why == "--plot: no_such_module is not installed (pip install 'jaxrec[plots]'); skipped"


def test_plain_progress_lines_with_eta():
    stream = io.StringIO()  # not a terminal: plain lines every 2 steps and at the end
    p = Progress(every=2, stream=stream)
    p.note("preparing synthetic data...")
    p.start(5)
    for step in range(1, 6):
        p.update(step, step * 8, loss=0.5)
    p.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "preparing synthetic data..."
    assert [ln.split()[1] for ln in lines[1:]] == ["1/5", "2/5", "4/5", "5/5"]
    assert "samples/s" in lines[-1] and "eta 0:00:00" in lines[-1] and "loss 0.5000" in lines[-1]


def test_quiet_progress_prints_only_warnings():
    stream = io.StringIO()
    p = Progress(quiet=True, stream=stream)
    p.note("hidden")
    p.start(2)
    p.update(2, 16, loss=0.5)
    p.warn("--plot: skipped")
    assert stream.getvalue() == "--plot: skipped\n"


def test_plan_table():
    rows = [("t_cat_0", "row_wise", (0, 1, 2, 3)), ("t_cat_1", "table_wise", (5,))]
    rows.append(("t_cat_2", "column_wise", (0, 1)))
    assert plan_table(rows).splitlines() == [
        "table    sharding     ranks",
        "t_cat_0  row_wise     0-3",
        "t_cat_1  table_wise   5",
        "t_cat_2  column_wise  0,1",
    ]


def test_rate_leaves_out_the_first_step_and_pauses(monkeypatch):
    # samples/s means what the summary's samples_per_s means: training after the first
    # step (which compiles), evaluations (paused) left out; the ETA is wall-clock.
    clock = iter([100.0, 101.0, 111.0, 112.0])
    monkeypatch.setattr("jaxrec.jobs.progress.time.perf_counter", lambda: next(clock))
    stream = io.StringIO()
    p = Progress(every=1, stream=stream, units={"loss": "nats"})
    p.start(3)
    p.update(1, 8, loss=0.5)  # t=100: the first step, compiled
    with p.paused():  # t=101..111: an evaluation
        pass
    p.update(3, 24, loss=0.25)  # t=112: 16 samples in 12 - 10 s of training
    first, last = stream.getvalue().splitlines()
    assert first == "step 1/3  loss 0.5000 nats"
    assert last == "step 3/3  loss 0.2500 nats  8 samples/s  eta 0:00:00"
