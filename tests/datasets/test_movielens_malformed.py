"""Malformed MovieLens folders: bad bytes, values, ids, empty files; errors name file and line."""

import numpy as np
import pytest

from jaxrec.datasets import load_movielens, movielens_split

RECBOLE_HEADER = ["user_id:token", "item_id:token", "rating:float", "timestamp:float"]
ROWS = [("1", "10", "5", "100"), ("1", "20", "3", "200"), ("2", "10", "4", "50")]


def write_format(root, fmt, rows=ROWS, raw_line=None):
    """A ``fmt`` folder rating ``rows``; ``raw_line`` (bytes) becomes the second rating."""
    root.mkdir()
    sep, name, header = {
        "ml-100k": ("\t", "u.data", None),
        "ml-1m": ("::", "ratings.dat", None),
        "ml-20m": (",", "ratings.csv", "userId,movieId,rating,timestamp"),
        "recbole": ("\t", "ml.inter", "\t".join(RECBOLE_HEADER)),
    }[fmt]
    lines = [sep.join(r).encode() for r in rows]
    if raw_line is not None:
        lines.insert(1, raw_line.replace(b"\t", sep.encode()))
    if header:
        lines.insert(0, header.encode())
    (root / name).write_bytes(b"".join(x + b"\n" for x in lines))
    first = 2 if header else 1  # file line of rows[0]
    return root / name, first + 1  # the file and the line of raw_line


@pytest.mark.parametrize("fmt", ["ml-20m", "recbole"])  # UTF-8 formats
def test_bad_bytes_name_file_and_line(tmp_path, fmt):
    path, line = write_format(tmp_path / "m", fmt, raw_line=b"3\t2\xff0\t4\t70")
    with pytest.raises(ValueError, match=rf"{path.name}:{line}: not valid UTF-8 .*byte 0xff"):
        load_movielens(tmp_path / "m")


def test_bad_bytes_in_movies_csv(tmp_path):
    write_format(tmp_path / "m", "ml-20m")
    (tmp_path / "m" / "movies.csv").write_bytes(
        b"movieId,title,genres\n10,Heat,Action\n20,Caf\xe9,Drama\n"
    )
    with pytest.raises(ValueError, match=r"movies.csv:3: not valid UTF-8"):
        load_movielens(tmp_path / "m")


@pytest.mark.parametrize("fmt", ["ml-100k", "ml-1m", "ml-20m", "recbole"])
@pytest.mark.parametrize(
    "raw, message",
    [
        (b"3\t20\tnan\t70", r"rating 'nan' is not a finite number"),
        (b"3\t20\tinf\t70", r"rating 'inf' is not a finite number"),
        (b"3\t20\tfour\t70", r"rating 'four' is not a finite number"),
        (b"3\t20\t4\tinf", r"timestamp 'inf' is not a finite number"),
        (b"3\t20\t4\tsoon", r"timestamp 'soon' is not a finite number"),
        (b"\t20\t4\t70", r"empty user id"),
        (b"3\t\t4\t70", r"empty item id"),
    ],
)
def test_bad_values_name_file_and_line(tmp_path, fmt, raw, message):
    path, line = write_format(tmp_path / "m", fmt, raw_line=raw)
    with pytest.raises(ValueError, match=rf"{path.name}:{line}: {message}"):
        load_movielens(tmp_path / "m")


@pytest.mark.parametrize("fmt", ["ml-100k", "ml-1m", "ml-20m"])
@pytest.mark.parametrize("rating", ["7", "-1", "0"])
def test_grouplens_ratings_outside_their_scale(tmp_path, fmt, rating):
    path, line = write_format(tmp_path / "m", fmt, raw_line=f"3\t20\t{rating}\t70".encode())
    with pytest.raises(ValueError, match=rf"{path.name}:{line}: rating {rating} is outside"):
        load_movielens(tmp_path / "m")


@pytest.mark.parametrize("fmt", ["ml-100k", "ml-1m", "ml-20m", "recbole"])
def test_empty_ratings_file_names_it(tmp_path, fmt):
    path, _ = write_format(tmp_path / "m", fmt, rows=[])
    with pytest.raises(ValueError, match=rf"{path.name}: no ratings"):
        load_movielens(tmp_path / "m")


def test_empty_atomic_file_names_it(tmp_path):
    write_format(tmp_path / "m", "recbole")
    (tmp_path / "m" / "ml.user").write_bytes(b"")
    with pytest.raises(ValueError, match=r"ml.user: empty file"):
        load_movielens(tmp_path / "m")


def test_non_ascii_digit_ids_are_tokens(tmp_path):
    # latin-1 0xb2 is "²": str.isdigit() says yes but int() says no; it used to crash the sort
    write_format(tmp_path / "m", "ml-100k", raw_line=b"\xb2\t20\t4\t70")
    data = load_movielens(tmp_path / "m")
    assert sorted(data.vocab["user_id"]) == sorted(["1", "2", "\u00b2"])
    assert data.vocab["user_id"]["\u00b2"] == 2  # after the numeric ids


@pytest.mark.parametrize("fraction, empty", [(0.2, "test"), (0.9, "train")])
def test_split_with_an_empty_side_names_the_folder(tmp_path, fraction, empty):
    # one rating per user: a time split holds out round(fraction) = 0 or 1 of each
    rows = [(str(u), "10", "4", "1") for u in range(5)]
    write_format(tmp_path / "m", "ml-1m", rows=rows)
    with pytest.raises(ValueError, match=rf"{empty} split of .*m is empty"):
        movielens_split(tmp_path / "m", test_fraction=fraction)
    train, test = movielens_split(tmp_path / "m", split="random", test_fraction=0.5, seed=3)
    assert train.num_rows + test.num_rows == 5 and np.isfinite(train.ratings).all()
