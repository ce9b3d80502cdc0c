import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]


def test_intro_example_prints_the_tutorial_numbers():
    out = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "examples" / "intro.py")],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert "[[0.6299 0.5843 0.4988 0.6115]]" in out  # EmbeddingBag mean over ids [1, 3]
    assert "Lengths:  [3 4 2 2]" in out and "(2, 128)" in out


def test_sharded_train_example_runs():
    out = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "examples" / "sharded_train.py")],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    assert "ShardedEmbeddingBagCollection" in out and "row_wise" in out


def test_cached_train_example_runs():
    """A small run: the cache warms (hits), and the restored all-device model predicts
    what the cached one does (the example exits 1 otherwise)."""
    out = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "examples" / "cached_train.py"),
         "--rows", "20000", "--steps", "5", "--batch-size", "128"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    assert "predictions equal: True" in out and "hit rate 0." in out
