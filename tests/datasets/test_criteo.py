"""Criteo: TSV parsing, TorchRec's npy conversion (parity), splits, hashing, multi-hot."""

import io
import warnings

import chex
import numpy as np
import pytest

from jaxrec.datasets import (
    CriteoDataset,
    CriteoParseError,
    MultiHot,
    ParseStats,
    criteo_split,
    iter_criteo_tsv,
    preprocess_criteo,
    read_criteo_tsv,
    synthetic_criteo,
    synthetic_criteo_split,
    tsv_to_npys,
)
from jaxrec.datasets.criteo import main as criteo_main


def fake_rows(n, seed=0, label=True):
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        ints = [str(x) for x in rng.integers(-3, 500, 13)]
        cats = [f"{x:08x}" for x in rng.integers(0, 2**32, 26)]
        for j in rng.choice(39, 4, replace=False):  # missing values
            (ints if j < 13 else cats)[j % 13 if j < 13 else j - 13] = ""
        lines.append("\t".join(([str(rng.integers(0, 2))] if label else []) + ints + cats))
    return lines


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def python_parse(line, label=True):
    f = line.split("\t")
    lab = int(f[0] or "0") if label else -1
    off = int(label)
    dense = [int(x or "0") for x in f[off : off + 13]]
    sparse = [int(x or "0", 16) for x in f[off + 13 :]]
    return lab, dense, sparse


def test_parse_matches_python_across_chunks(tmp_path):
    lines = fake_rows(50)
    path = write(tmp_path / "day_0", lines)
    labels, dense, sparse = read_criteo_tsv(path, chunk_rows=7)
    ref = [python_parse(x) for x in lines]
    assert labels.dtype == np.int32 and dense.dtype == sparse.dtype == np.int64
    assert labels.tolist() == [r[0] for r in ref]
    assert dense.tolist() == [r[1] for r in ref]
    assert sparse.tolist() == [r[2] for r in ref]
    assert dense.min() == -3  # negatives kept, as TorchRec


@pytest.mark.parametrize(
    "bad, message",
    [
        ("1\t2\t3", "expected 40 tab-separated fields, got 3"),
        ("\t".join(["1", "x"] + ["1"] * 12 + ["a"] * 26), "int_0 'x' is not an integer"),
        ("\t".join(["1"] * 15 + ["zz"] + ["a"] * 24), "cat_1 'zz' is not hexadecimal"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad, message):
    lines = fake_rows(10)
    lines.insert(8, bad)
    path = write(tmp_path / "train.txt", lines)
    with pytest.raises(CriteoParseError, match=rf"train.txt:9: {message}"):
        read_criteo_tsv(path, chunk_rows=4)  # line 9 is in the third chunk
    stats = ParseStats()
    labels, _, _ = read_criteo_tsv(path, chunk_rows=4, on_error="skip", stats=stats)
    assert (stats.lines, stats.skipped, len(labels)) == (11, 1, 10)
    assert "train.txt:9" in stats.examples[0]


def _torchrec_tsv_to_npys(monkeypatch, *args):
    """TorchRec's own BinaryCriteoUtils.tsv_to_npys, with plain files instead of iopath."""
    criteo = pytest.importorskip("torchrec.datasets.criteo")

    class PlainFiles:
        def __init__(self, paths, mode="r", **kw):
            self.paths = list(paths)

        def __iter__(self):
            for p in self.paths:
                with open(p) as f:
                    yield p, io.StringIO(f.read())

    class Manager:
        open = staticmethod(open)

    monkeypatch.setattr(criteo, "LoadFiles", PlainFiles)
    monkeypatch.setattr(criteo, "_get_path_manager", lambda key: Manager())
    with warnings.catch_warnings():  # torch datapipes warn about TorchRec's local row mapper
        warnings.simplefilter("ignore", UserWarning)
        criteo.BinaryCriteoUtils.tsv_to_npys(*args)


@pytest.mark.parametrize("name, label", [("day_0", True), ("test.txt", False)])
def test_npy_files_equal_torchrec(tmp_path, monkeypatch, name, label):
    path = write(tmp_path / name, fake_rows(40, seed=1, label=label))
    dataset = "criteo_1tb" if label else "criteo_kaggle"
    ours = [tmp_path / f"ours_{p}.npy" for p in ("dense", "sparse", "labels")]
    theirs = [tmp_path / f"torchrec_{p}.npy" for p in ("dense", "sparse", "labels")]
    tsv_to_npys(path, *ours, dataset)
    _torchrec_tsv_to_npys(monkeypatch, str(path), *map(str, theirs), dataset)
    for a, b in zip(ours, theirs, strict=True):
        chex.assert_trees_all_equal(np.load(a), np.load(b), strict=True)  # dtype, shape, values
    assert np.load(ours[0]).dtype == np.float32 and np.load(ours[1]).dtype == np.int64
    assert np.load(ours[2]).shape == (40, 1)
    if not label:
        assert (np.load(ours[2]) == -1).all()


def _write_days(root, days=3, rows=30):
    root.mkdir()
    for d in range(days):
        write(root / f"day_{d}", fake_rows(rows, seed=10 + d))


def test_split_npy_and_tsv_days_agree(tmp_path):
    _write_days(tmp_path / "tsv")
    written = preprocess_criteo(tmp_path / "tsv", tmp_path / "npy")
    assert [p.name for p in written] == ["day_0_dense.npy", "day_1_dense.npy", "day_2_dense.npy"]
    sizes = [5 + k for k in range(26)]
    a_train, a_eval = criteo_split(tmp_path / "npy", num_embeddings=sizes)
    b_train, b_eval = criteo_split(tmp_path / "tsv", num_embeddings=sizes)
    assert (a_train.num_rows, a_eval.num_rows) == (60, 15)  # days 0-1; first half of day 2
    assert (b_train.num_rows, b_eval.num_rows) == (60, 15)
    for x, y in [(a_train, b_train), (a_eval, b_eval)]:
        for bx, by in zip(x.batches(8, seed=2), y.batches(8, seed=2), strict=True):
            np.testing.assert_array_equal(bx.dense_features, by.dense_features)
            np.testing.assert_array_equal(bx.sparse_features.values(), by.sparse_features.values())
            np.testing.assert_array_equal(bx.labels, by.labels)
    # batch contents: hashed ids of the right rows, key-major
    ref = [python_parse(x) for x in (tmp_path / "tsv" / "day_2").read_text().splitlines()]
    b = next(a_eval.batches(15, shuffle=False))
    assert b.sparse_features.capacity_per_key() == (15,) * 26
    for k in (0, 7, 25):
        got = np.asarray(b.sparse_features[f"cat_{k}"].values())
        assert got.tolist() == [r[2][k] % sizes[k] for r in ref[:15]]
    assert b.labels.tolist() == [r[0] for r in ref[:15]]
    dense = np.array([r[1] for r in ref])
    np.testing.assert_allclose(b.dense_features, np.log(dense - dense.min() + 2)[:15], rtol=1e-6)


def test_kaggle_single_file_split_and_errors(tmp_path):
    write(tmp_path / "train.txt", fake_rows(70, seed=3))
    train, test = criteo_split(tmp_path, num_embeddings=100)
    assert (train.num_rows, test.num_rows) == (60, 10)
    assert (
        criteo_main(
            [
                "preprocess",
                "--input-dir",
                str(tmp_path),
                "--output-dir",
                str(tmp_path / "npy"),
                "--dataset-name",
                "criteo_kaggle",
            ]
        )
        == 0
    )
    train2, _ = criteo_split(tmp_path / "npy", num_embeddings=100)
    np.testing.assert_array_equal(
        next(train.batches(60, shuffle=False)).sparse_features.values(),
        next(train2.batches(60, shuffle=False)).sparse_features.values(),
    )
    with pytest.raises(FileNotFoundError, match="no Criteo data"):
        criteo_split(tmp_path / "npy" / "nothing_here")
    with pytest.raises(ValueError, match="26 ints"):
        CriteoDataset.from_npy([tmp_path / "npy" / "train"], num_embeddings_per_feature=[3, 4])


def mlperf_tables(sizes, bags, dist):
    """MLPerf DLRM-DCNv2's Multihot tables, written as there (global np.random)."""
    np.random.seed(0)
    out = []
    for n, m in zip(sizes, bags, strict=True):
        if dist == "uniform":
            extra = np.random.randint(0, n, size=(n, m - 1))
        else:
            with np.errstate(invalid="ignore"):
                extra = np.random.pareto(a=0.25, size=(n, m - 1)).astype(np.int32) % n
        out.append(np.concatenate((np.arange(n)[:, None], extra), axis=-1))
    return out


@pytest.mark.parametrize("dist", ["uniform", "pareto"])
def test_multi_hot_table_matches_mlperf(dist):
    sizes, bags = [50, 7, 300], [3, 1, 5]
    mh = MultiHot(bags, sizes, dist_type=dist)
    ref = mlperf_tables(sizes, bags, dist)
    ids = np.array([0, 6, 3, 3])
    for k in range(3):
        np.testing.assert_array_equal(mh.expand(k, ids), ref[k][ids])


@pytest.mark.parametrize("dist", ["uniform", "pareto"])
def test_multi_hot_hash_is_deterministic(dist):
    mh = MultiHot([4, 2], [1000, 10], dist_type=dist, method="hash", seed=3)
    ids = np.arange(1000)
    a, b = mh.expand(0, ids), mh.expand(0, ids[::-1])[::-1]
    np.testing.assert_array_equal(a, b)  # a pure function of the id
    assert a.shape == (1000, 4) and (a[:, 0] == ids).all()
    assert a.min() >= 0 and a.max() < 1000
    assert not np.array_equal(
        a, MultiHot([4, 2], [1000, 10], dist_type=dist, method="hash", seed=4).expand(0, ids)
    )
    if dist == "uniform":
        assert abs(a[:, 1:].mean() - 499.5) < 15
    else:  # pareto with a=0.25 piles up on small ids
        assert np.mean(a[:, 1:] < 10) > 0.4
    with pytest.raises(ValueError, match="use method='hash'"):
        MultiHot([100], [10**8])


def test_criteo_multi_hot_batches(tmp_path):
    _write_days(tmp_path / "tsv", days=2, rows=20)
    sizes = [97] * 26
    bags = [1 + k % 4 for k in range(26)]
    mh = MultiHot(bags, sizes)
    train, _ = criteo_split(tmp_path / "tsv", num_embeddings=sizes, multi_hot=mh)
    one_hot, _ = criteo_split(tmp_path / "tsv", num_embeddings=sizes)
    caps = {b.sparse_features.capacity_per_key() for b in train.batches(8)}
    assert caps == {tuple(8 * m for m in bags)}
    b = next(train.batches(8, seed=1))
    b1 = next(one_hot.batches(8, seed=1))
    for k in (0, 3, 5):
        kjt = b.sparse_features[f"cat_{k}"]
        assert kjt.lengths().tolist() == [bags[k]] * 8
        ids = np.asarray(b1.sparse_features[f"cat_{k}"].values())
        np.testing.assert_array_equal(np.asarray(kjt.to_dense()), mh.expand(k, ids))


def test_synthetic_criteo():
    train, test = synthetic_criteo_split(3000, 1000, seed=5)
    assert train.keys == [f"cat_{i}" for i in range(26)] and train.num_dense == 13
    assert max(train.num_embeddings_per_feature) == 1000
    b = next(train.batches(64))
    assert b.dense_features.shape == (64, 13)
    assert b.sparse_features.capacity_per_key() == (64,) * 26
    assert 0.55 < train.reference_metrics(test)["oracle_auc"] < 1
    again = synthetic_criteo_split(10, 1000, seed=5)[1]
    np.testing.assert_array_equal(test.labels(), again.labels())
    mh = synthetic_criteo(100, multi_hot_sizes=[2] * 26)
    assert next(mh.batches(10)).sparse_features.capacity_per_key() == (20,) * 26
    assert (next(mh.batches(10)).sparse_features.lengths() == 2).all()


def test_iter_yields_chunks(tmp_path):
    path = write(tmp_path / "day_1", fake_rows(10))
    sizes = [len(c[0]) for c in iter_criteo_tsv(path, chunk_rows=4)]
    assert sizes == [4, 4, 2]
