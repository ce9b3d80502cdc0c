"""Datasets opened for part p of 2: their batches interleaved are the one-part stream's,
and each part reads only its own rows."""

import numpy as np
import pytest

from jaxrec.datasets import Part, criteo_split, movielens_split, preprocess_criteo
from jaxrec.datasets.criteo_index import TsvColumns
from jaxrec.datasets.movielens import OwnedRagged


def fake_rows(n, seed=0):
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        ints = [str(x) for x in rng.integers(-3, 500, 13)]
        cats = [f"{x:08x}" for x in rng.integers(0, 2**32, 26)]
        ints[int(rng.integers(13))] = ""  # a missing value
        lines.append("\t".join([str(rng.integers(0, 2))] + ints + cats))
    return lines


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


SIZES = [5 + k for k in range(26)]
BATCH = 7


def _criteo_dir(tmp_path, layout):
    tsv = tmp_path / "tsv"
    tsv.mkdir()
    if layout.startswith("days"):
        for d in range(3):
            write(tsv / f"day_{d}", fake_rows(40 + 9 * d, seed=10 + d))
    else:
        lines = fake_rows(150, seed=3)
        lines[17] = lines[17].replace("\t", " ", 1)  # malformed: skipped, not a row
        write(tsv / "train.txt", lines)
    if layout.endswith("npy"):
        name = "criteo_1tb" if layout.startswith("days") else "criteo_kaggle"
        preprocess_criteo(tsv, tmp_path / "npy", name, on_error="skip")
        return tmp_path / "npy"
    return tsv


def _arrays(batch):
    kjt = batch.sparse_features
    return (
        np.asarray(kjt.values()),
        np.asarray(kjt.lengths()),
        np.asarray(batch.dense_features),
        np.asarray(batch.labels),
    )


def _assert_same(a, b):
    for x, y in zip(_arrays(a), _arrays(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _check_stream(whole, parts, **kw):
    """Parts' batches interleaved == the whole stream; the tail's rows in order."""
    want = list(whole.batches(BATCH, part=Part(0, 1), **kw))
    got = [list(p.batches(BATCH, **kw)) for p in parts]  # each defaults to its own part
    full = whole.num_batches(BATCH * 2, part=Part(0, 1))
    for s in range(full):
        for p in range(2):
            _assert_same(got[p][s], want[2 * s + p])
    if not kw.get("drop_last", True):  # the rows after the last full round, split in two
        tail = [b for g in got for b in g[full:]]
        rows = sum(len(b.labels) for b in tail)
        assert rows == whole.num_rows - full * 2 * BATCH
        labels = np.concatenate([b.labels for b in tail])
        np.testing.assert_array_equal(labels, np.concatenate([b.labels for b in want[2 * full :]]))
    else:
        assert all(len(g) == full for g in got)


@pytest.mark.parametrize("layout", ["days-tsv", "days-npy", "one-tsv", "one-npy"])
def test_criteo_parts_rebuild_the_one_process_stream(tmp_path, layout):
    root = _criteo_dir(tmp_path, layout)
    whole = criteo_split(root, num_embeddings=SIZES, on_error="skip")
    parts = [
        criteo_split(root, num_embeddings=SIZES, on_error="skip", part=Part(p, 2)) for p in (0, 1)
    ]
    for split in (0, 1):  # train, eval
        w, ps = whole[split], [p[split] for p in parts]
        assert all(p.num_rows == w.num_rows and p.part.count == 2 for p in ps)
        for shuffle in (False, True):
            for epoch in range(3):
                _check_stream(w, ps, shuffle=shuffle, seed=5, epoch=epoch)
        _check_stream(w, ps, shuffle=True, seed=5, epoch=1, drop_last=False)


def _columns(data):
    """Each table's array-likes (dense, labels, sparse) of a CriteoDataset."""
    return [(t.dense, t.labels, s) for t, s in zip(data.tables, data._sparse, strict=True)]


class _Recording:
    """An array wrapper that records the rows read from it."""

    def __init__(self, arr, log):
        self.arr, self.log = arr, log
        self.shape, self.ndim, self.dtype = arr.shape, arr.ndim, arr.dtype

    def __len__(self):
        return len(self.arr)

    def __getitem__(self, rows):
        self.log.append(np.asarray(rows))
        return self.arr[rows]


@pytest.mark.parametrize("layout", ["days-tsv", "days-npy", "one-tsv"])
def test_a_part_reads_only_its_rows(tmp_path, layout):
    root = _criteo_dir(tmp_path, layout)
    train = criteo_split(root, num_embeddings=SIZES, on_error="skip", part=Part(1, 2))[0]
    mine = np.sort(np.concatenate(train.batch_rows(BATCH, seed=5, epoch=2)))
    share = 2 * BATCH * (train.num_rows // (2 * BATCH)) // 2
    assert len(mine) == share
    logs, indexes = [], [c[0].index for c in _columns(train) if isinstance(c[0], TsvColumns)]
    for t, (dense, labels, sparse) in enumerate(_columns(train)):
        logs.append([])
        if layout.endswith("tsv"):  # nothing parsed when opened, and each batch parses once
            assert isinstance(dense, TsvColumns) and dense.index.rows_parsed == 0
        train.tables[t] = type(train.tables[t])(
            _Recording(dense, logs[t]), train.tables[t].sparse, _Recording(labels, logs[t])
        )
        train._sparse[t] = _Recording(sparse, logs[t])
    batches = list(train.batches(BATCH, seed=5, epoch=2))
    assert len(batches) == train.num_batches(BATCH) == share // BATCH
    read = np.sort(
        np.concatenate(
            [np.unique(np.concatenate(log)) + train._starts[t] for t, log in enumerate(logs) if log]
        )
    )
    np.testing.assert_array_equal(read, mine)  # its rows, and no others
    if layout.endswith("tsv"):
        parsed = {id(x): x.rows_parsed for x in indexes}  # the eval day shares one
        assert sum(parsed.values()) == share  # dense, sparse and labels: one parse


def _movielens_dir(tmp_path, n=600):
    """An ml-1m folder: ratings.dat, users.dat (side features), movies.dat (genre bags)."""
    rng = np.random.default_rng(0)
    root = tmp_path / "ml"
    root.mkdir()
    users, items = rng.integers(1, 40, n), rng.integers(1, 60, n)
    stars, times = rng.integers(1, 6, n), rng.permutation(n) + 10**9
    rows = zip(users, items, stars, times, strict=True)
    (root / "ratings.dat").write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in rows))
    (root / "users.dat").write_text(
        "".join(f"{u}::{'MF'[u % 2]}::{u % 7}::{u % 5}::0{u}\n" for u in range(1, 40))
    )
    genres = ["Action", "Comedy", "Drama", "Horror"]
    (root / "movies.dat").write_text(
        "".join(
            f"{m}::Film {m}::{'|'.join(genres[: m % 4 + 1] if m % 5 else [])}\n"
            for m in range(1, 60)
        )
    )
    return root


def test_movielens_parts_rebuild_the_one_process_stream(tmp_path):
    root = _movielens_dir(tmp_path)
    whole = movielens_split(root)
    parts = [movielens_split(root, part=Part(p, 2)) for p in (0, 1)]
    for split in (0, 1):
        w, ps = whole[split], [p[split] for p in parts]
        assert w.keys == ps[0].keys and w.max_ids_per_sample == ps[1].max_ids_per_sample
        for shuffle in (False, True):
            for epoch in range(3):
                _check_stream(w, ps, shuffle=shuffle, seed=5, epoch=epoch)
        _check_stream(w, ps, shuffle=True, seed=5, epoch=1, drop_last=False)
    # a part holds each rating's two ids (int32); side features once per user and item
    held = parts[0][0].tables[0].sparse
    assert [c.dtype for c in held[:2]] == [np.int32, np.int32]
    assert isinstance(held[-1], OwnedRagged) and len(held[-1].offsets) == 60  # 59 movies + 1
