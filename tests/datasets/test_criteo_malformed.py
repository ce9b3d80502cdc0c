"""Malformed Criteo input (TSV lines, npy files, values): a clear error naming file and line or row.

Each case is a bad file built in ``tmp_path``; with ``on_error="skip"`` a bad
line is skipped and counted instead.
"""

import math

import numpy as np
import pytest

from jaxrec.datasets import (
    CriteoDataset,
    CriteoParseError,
    ParseStats,
    criteo_split,
    load_npy,
    load_tsv,
    read_criteo_tsv,
    tsv_to_npys,
)


def line(label="1", dense=None, cats=None) -> str:
    dense = [str(i) for i in range(13)] if dense is None else dense
    cats = [f"{k:08x}" for k in range(26)] if cats is None else cats
    return "\t".join([label, *dense, *cats])


def write_bytes(path, lines):
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def with_dense(i, text):
    dense = [str(k) for k in range(13)]
    dense[i] = text
    return line(dense=dense)


def with_cat(i, text):
    cats = [f"{k:08x}" for k in range(26)]
    cats[i] = text
    return line(cats=cats)


BAD_LINES = [
    # bytes that are not ASCII (Criteo files are ASCII): not a UnicodeDecodeError
    (line().encode().replace(b"00000003", b"0000\xff003"), r"byte 0xff at column \d+ is not ASCII"),
    (line().replace("00000003", "0000\u00e9003").encode(), r"byte 0xc3 at column \d+ is not ASCII"),
    (with_dense(2, "\u0661\u0662"), r"byte 0xd9 at column 7 is not ASCII"),  # int() takes these
    # labels must be 0 or 1 (empty is 0, as TorchRec)
    (line(label="2"), r"label '2' must be 0 or 1"),
    (line(label="-1"), r"label '-1' must be 0 or 1"),
    (line(label="x"), r"label 'x' must be 0 or 1"),
    # dense: an optional minus and digits; Python's int() also takes these
    (with_dense(4, " 5"), r"int_4 ' 5' is not an integer"),
    (with_dense(4, "1_0"), r"int_4 '1_0' is not an integer"),
    (with_dense(4, "+3"), r"int_4 '\+3' is not an integer"),
    (with_dense(3, str(2**63)), rf"int_3 '{2**63}' does not fit in int64"),
    # categoricals: hex digits only; int(x, 16) also takes these
    (with_cat(1, "0x1f"), r"cat_1 '0x1f' is not hexadecimal"),
    (with_cat(1, "1_f"), r"cat_1 '1_f' is not hexadecimal"),
    (with_cat(1, "-1f"), r"cat_1 '-1f' is not hexadecimal"),
    (with_cat(2, "8" + "0" * 15), r"cat_2 '80{15}' does not fit in int64"),
]


@pytest.mark.parametrize("chunk_rows", [2, 100])
@pytest.mark.parametrize("bad, message", BAD_LINES)
def test_bad_line_names_file_and_line(tmp_path, bad, message, chunk_rows):
    good = [line(label=str(i % 2), dense=[str(i + k) for k in range(13)]) for i in range(5)]
    path = write_bytes(tmp_path / "day_0", [*good[:3], bad, *good[3:]])
    with pytest.raises(CriteoParseError, match=rf"day_0:4: {message}"):
        read_criteo_tsv(path, chunk_rows=chunk_rows)
    stats = ParseStats()
    labels, dense, _ = read_criteo_tsv(path, chunk_rows=chunk_rows, on_error="skip", stats=stats)
    assert (stats.lines, stats.skipped) == (6, 1)
    assert labels.tolist() == [i % 2 for i in range(5)]
    assert dense[:, 0].tolist() == list(range(5))


def test_empty_dense_and_cat_fields_are_zero_and_crlf_is_accepted(tmp_path):
    # not malformed: TorchRec reads an empty field as 0; a Windows line end is stripped
    dense = [""] * 13
    path = write_bytes(tmp_path / "day_0", [line(label="", dense=dense) + "\r", line()])
    labels, d, s = read_criteo_tsv(path)
    assert labels.tolist() == [0, 1] and d[0].tolist() == [0] * 13 and s[0, 0] == 0


def log_transform_reference(dense_rows):
    """``log(x - min + 2)`` with exact Python integers, rounded once to float32."""
    flat = [x for row in dense_rows for x in row]
    low = min(flat)
    return np.array([[math.log(x - low + 2) for x in row] for row in dense_rows], np.float32)


@pytest.mark.parametrize(
    "big", [[2**62, -(2**62)], [2**63 - 1, -5], [-(2**63) + 1, 7], [-(2**63), 2**63 - 1]]
)
def test_dense_range_beyond_int64_stays_finite(tmp_path, big):
    # each value fits int64 but x - min + 2 does not: it used to wrap to NaN / -inf
    rows = [[b] + list(range(12)) for b in big] + [list(range(13))]
    path = write_bytes(tmp_path / "day_0", [line(dense=[str(x) for x in r]) for r in rows])
    dense, _, _ = load_tsv(path)
    ref = log_transform_reference(rows)
    assert np.isfinite(dense).all()
    np.testing.assert_allclose(dense, ref, rtol=1e-6)
    out = [tmp_path / f"o_{p}.npy" for p in ("dense", "sparse", "labels")]
    tsv_to_npys(path, *out)
    np.testing.assert_allclose(np.load(out[0]), ref, rtol=1e-6)


def test_empty_file_raises_naming_it(tmp_path):
    root = tmp_path / "days"
    root.mkdir()
    write_bytes(root / "day_0", [line()] * 4)
    (root / "day_1").write_bytes(b"")
    write_bytes(root / "day_2", [line()] * 4)
    for on_error in ("raise", "skip"):
        with pytest.raises(CriteoParseError, match=r"day_1: empty file"):
            criteo_split(root, num_embeddings=10, on_error=on_error)
    with pytest.raises(CriteoParseError, match=r"day_1: empty file"):
        read_criteo_tsv(root / "day_1")


def test_file_with_only_skipped_lines_raises(tmp_path):
    path = write_bytes(tmp_path / "train.txt", ["1\t2", line(label="7"), b"\xfe"])
    with pytest.raises(CriteoParseError, match=r"train.txt: no valid lines \(3 of 3 skipped"):
        read_criteo_tsv(path, on_error="skip")


def test_single_file_too_small_to_split_raises(tmp_path):
    write_bytes(tmp_path / "train.txt", [line()] * 6)
    with pytest.raises(ValueError, match=r"train.txt has 6 rows.*at least 7"):
        criteo_split(tmp_path, num_embeddings=10)


def _npy_day(root, n=8, name="day_0"):
    root.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    np.save(root / f"{name}_dense.npy", rng.random((n, 13), dtype=np.float32))
    np.save(root / f"{name}_sparse.npy", rng.integers(0, 1000, (n, 26)))
    np.save(root / f"{name}_labels.npy", rng.integers(0, 2, (n, 1)).astype(np.int32))
    return root / name


@pytest.mark.parametrize("part", ["dense", "sparse", "labels"])
@pytest.mark.parametrize("mmap", [True, False])
def test_truncated_npy_names_the_file(tmp_path, part, mmap):
    prefix = _npy_day(tmp_path / "npy")
    path = tmp_path / "npy" / f"day_0_{part}.npy"
    path.write_bytes(path.read_bytes()[:-9])
    with pytest.raises(ValueError, match=rf"day_0_{part}.npy.*truncated or corrupt"):
        load_npy(prefix, mmap=mmap)


def test_corrupt_npy_names_the_file(tmp_path):
    prefix = _npy_day(tmp_path / "npy")
    (tmp_path / "npy" / "day_0_sparse.npy").write_bytes(b"not an npy file at all")
    with pytest.raises(ValueError, match=r"day_0_sparse.npy.*truncated or corrupt"):
        criteo_split(tmp_path / "npy", num_embeddings=10)
    with pytest.raises(ValueError, match=r"day_0_sparse.npy.*truncated or corrupt"):
        load_npy(prefix)


@pytest.mark.parametrize(
    "part, array, message",
    [
        ("dense", np.zeros((8, 12), np.float32), r"day_0_dense.npy: .*\[N, 13\]"),
        ("sparse", np.zeros((8, 26), np.float32), r"day_0_sparse.npy: .*integer"),
        ("dense", np.zeros((8, 13), np.int64), r"day_0_dense.npy: .*float"),
        ("labels", np.zeros((7, 1), np.int32), r"day_0_labels.npy: 7 rows.*8"),
        ("labels", np.zeros((8, 2), np.int32), r"day_0_labels.npy: .*\[N\] or \[N, 1\]"),
    ],
)
def test_npy_with_wrong_layout_names_the_file(tmp_path, part, array, message):
    prefix = _npy_day(tmp_path / "npy")
    np.save(tmp_path / "npy" / f"day_0_{part}.npy", array)
    with pytest.raises(ValueError, match=message):
        CriteoDataset.from_npy([prefix], num_embeddings_per_feature=10)


def test_npy_with_no_rows_names_the_file(tmp_path):
    _npy_day(tmp_path / "npy", n=6)
    _npy_day(tmp_path / "npy", n=0, name="day_1")
    with pytest.raises(ValueError, match=r"day_1.*no rows"):
        criteo_split(tmp_path / "npy", num_embeddings=10)


@pytest.mark.parametrize(
    "part, value, message",
    [
        ("dense", np.nan, r"day_0_dense.npy row 5: non-finite dense value nan"),
        ("dense", np.inf, r"day_0_dense.npy row 5: non-finite dense value inf"),
        ("labels", 2, r"day_0_labels.npy row 5: label 2.0 must be 0 or 1"),
        ("labels", -1, r"day_0_labels.npy row 5: label -1.0 must be 0 or 1"),
    ],
)
def test_bad_values_in_npy_are_reported_by_file_and_row(tmp_path, part, value, message):
    prefix = _npy_day(tmp_path / "npy")
    path = tmp_path / "npy" / f"day_0_{part}.npy"
    arr = np.load(path)
    arr[5, 0] = value
    np.save(path, arr)
    data = CriteoDataset.from_npy([prefix], num_embeddings_per_feature=10)
    next(data.batches(4, shuffle=False))  # rows 0-3 are fine
    with pytest.raises(ValueError, match=message):
        list(data.batches(4, shuffle=False))


def test_in_memory_arrays_with_bad_values_name_the_file_index():
    dense = np.zeros((4, 13), np.float32)
    dense[2, 7] = np.nan
    data = CriteoDataset(
        [np.zeros((3, 13), np.float32), dense],
        [np.zeros((3, 26), np.int64), np.zeros((4, 26), np.int64)],
        [np.zeros(3), np.zeros(4)],
        num_embeddings_per_feature=5,
    )
    with pytest.raises(ValueError, match=r"file 1 row 2: non-finite dense value nan"):
        list(data.batches(7, shuffle=False))


def test_bad_row_in_the_held_out_part_is_named_by_its_row_in_the_file(tmp_path):
    # Kaggle npy layout: one file, the last 1/7 evaluates; the error gives the row in the file
    prefix = _npy_day(tmp_path / "npy", n=14, name="train")
    arr = np.load(f"{prefix}_dense.npy")
    arr[13, 4] = np.nan
    np.save(f"{prefix}_dense.npy", arr)
    train, test = criteo_split(tmp_path / "npy", num_embeddings=10)
    list(train.batches(4))
    with pytest.raises(ValueError, match=r"train_dense.npy row 13: non-finite dense value nan"):
        list(test.batches(2, shuffle=False))
