"""MovieLens file readers: ml-100k, ml-1m, ml-20m / ml-25m and RecBole atomic files.

Each reader returns a :class:`RawRatings`: the interactions as strings and
numbers, and side features per user and per item (``{feature: {raw id:
[tokens]}}``; one token for a categorical, several for genres). TorchRec's
``torchrec.datasets.movielens`` reads only ml-20m/25m ``ratings.csv`` (+
``movies.csv``); the others follow GroupLens' READMEs and RecBole's atomic
file format (``name:type`` headers; ``token_seq`` split on spaces).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ML100K_GENRES = [
    "unknown",
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
]


@dataclasses.dataclass
class RawRatings:
    """Interactions (``users``, ``items`` raw id strings; ``ratings``, ``timestamps``) + sides."""

    users: list
    items: list
    ratings: np.ndarray
    timestamps: np.ndarray
    user_features: dict = dataclasses.field(default_factory=dict)
    item_features: dict = dataclasses.field(default_factory=dict)
    format: str = ""


def detect_format(root: Path) -> str:
    if (root / "u.data").exists():
        return "ml-100k"
    if (root / "ratings.dat").exists():
        return "ml-1m"
    if (root / "ratings.csv").exists():
        return "ml-20m"
    if list(root.glob("*.inter")):
        return "recbole"
    raise FileNotFoundError(
        f"no MovieLens files in {root}: expected u.data (ml-100k), ratings.dat (ml-1m), "
        "ratings.csv (ml-20m/25m) or a RecBole *.inter file "
        "(python -m jaxrec.datasets.movielens fetch gets ml-100k)"
    )


def read_movielens(path: str | os.PathLike) -> RawRatings:
    """Reads any supported MovieLens folder (format detected from its file names)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    fmt = detect_format(root)
    reader = {"ml-100k": _ml100k, "ml-1m": _ml1m, "ml-20m": _ml20m, "recbole": _recbole}[fmt]
    raw = reader(root)
    raw.format = fmt
    return raw


# GroupLens' READMEs: ml-100k and ml-1m 1-5 whole stars, ml-20m/25m 0.5-5 in half stars.
STAR_RANGE = (0.5, 5.0)


def _lines(path: Path, encoding: str) -> Iterator[tuple[int, str]]:
    """``(line number, text without the line end)``; undecodable bytes name file and line."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                yield i, raw.decode(encoding).rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{i}: not valid {encoding.upper()} (byte 0x{raw[e.start]:02x} at "
                    f"column {e.start + 1}); MovieLens' {path.suffix or path.name} files are "
                    f"{encoding.upper()}"
                ) from None


def _rows(path: Path, sep: str, fields: int | None, encoding: str, skip_header=False):
    """``(line number, fields)`` per non-empty line; a wrong field count names file and line."""
    for i, line in _lines(path, encoding):
        if (skip_header and i == 1) or not line:
            continue
        row = line.split(sep)
        if fields is not None and len(row) != fields:
            raise ValueError(
                f"{path}:{i}: expected {fields} fields separated by {sep!r}, got {len(row)}"
            )
        yield i, row


def _number(where: str, name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{where}: {name} {text!r} is not a finite number")
    return value


def _rating(where: str, user, item, rating, timestamp, stars: bool):
    """``(rating, timestamp)`` of one interaction, checked; errors start with ``where``."""
    if not user or not item:
        raise ValueError(f"{where}: empty {'user' if not user else 'item'} id")
    r = _number(where, "rating", rating)
    if stars and not STAR_RANGE[0] <= r <= STAR_RANGE[1]:
        raise ValueError(
            f"{where}: rating {rating} is outside MovieLens' {STAR_RANGE[0]}-{STAR_RANGE[1]} stars"
        )
    try:
        t = int(timestamp)
    except ValueError:
        t = int(_number(where, "timestamp", timestamp))
    return r, t


def _ratings(path, sep, encoding, skip_header=False) -> RawRatings:
    users, items, ratings, times = [], [], [], []
    for i, (u, it, r, t) in _rows(path, sep, 4, encoding, skip_header):
        rating, time = _rating(f"{path}:{i}", u, it, r, t, stars=True)
        ratings.append(rating)
        times.append(time)
        users.append(u)
        items.append(it)
    if not ratings:
        raise ValueError(f"{path}: no ratings (an empty file)")
    return RawRatings(users, items, np.array(ratings, np.float32), np.array(times, np.int64))


def _ml100k(root: Path) -> RawRatings:
    raw = _ratings(root / "u.data", "\t", "latin-1")
    if (root / "u.user").exists():
        side = {"age": {}, "gender": {}, "occupation": {}}
        for _, (u, age, gender, occ, _zip) in _rows(root / "u.user", "|", 5, "latin-1"):
            side["age"][u], side["gender"][u], side["occupation"][u] = [age], [gender], [occ]
        raw.user_features = side
    if (root / "u.item").exists():
        genres = {}
        for _, row in _rows(root / "u.item", "|", 24, "latin-1"):
            genres[row[0]] = [
                g for g, flag in zip(ML100K_GENRES, row[5:], strict=True) if flag == "1"
            ]
        raw.item_features = {"genres": genres}
    return raw


def _ml1m(root: Path) -> RawRatings:
    raw = _ratings(root / "ratings.dat", "::", "latin-1")
    if (root / "users.dat").exists():
        side = {"gender": {}, "age": {}, "occupation": {}}
        for _, (u, gender, age, occ, _zip) in _rows(root / "users.dat", "::", 5, "latin-1"):
            side["gender"][u], side["age"][u], side["occupation"][u] = [gender], [age], [occ]
        raw.user_features = side
    if (root / "movies.dat").exists():
        genres = {
            m: g.split("|") for _, (m, _t, g) in _rows(root / "movies.dat", "::", 3, "latin-1")
        }
        raw.item_features = {"genres": genres}
    return raw


def _ml20m(root: Path) -> RawRatings:
    raw = _ratings(root / "ratings.csv", ",", "utf-8", skip_header=True)
    movies = root / "movies.csv"
    if movies.exists():
        genres = {}
        reader = csv.reader(line for _, line in _lines(movies, "utf-8"))
        for row in reader:
            i = reader.line_num
            if i == 1:
                continue
            if len(row) != 3:
                raise ValueError(f"{movies}:{i}: expected movieId,title,genres; got {row}")
            # "(no genres listed)" is MovieLens' spelling of an empty bag
            genres[row[0]] = [] if row[2] == "(no genres listed)" else row[2].split("|")
        raw.item_features = {"genres": genres}
    return raw


def read_atomic(path: Path) -> tuple[dict[str, list], dict[str, str]]:
    """A RecBole atomic file -> ``({name: column}, {name: type})``; ``*_seq`` cells are lists."""
    columns, types, _ = _read_atomic(Path(path))
    return columns, types


def _read_atomic(path: Path) -> tuple[dict[str, list], dict[str, str], list[int]]:
    """:func:`read_atomic` plus the file line of each row."""
    columns: dict[str, list] = {}
    types = []
    numbers = []
    lines = _lines(path, "utf-8")
    _, first = next(lines, (1, None))
    if first is None:
        raise ValueError(f"{path}: empty file (a RecBole atomic file starts with a header line)")
    for h in first.split("\t"):
        name, _, kind = h.partition(":")
        if kind not in ("token", "token_seq", "float", "float_seq"):
            raise ValueError(
                f"{path}:1: header field {h!r} needs a type: name:token, "
                "name:token_seq, name:float or name:float_seq"
            )
        columns[name] = []
        types.append((name, kind))
    for i, line in lines:
        if not line:
            continue
        row = line.split("\t")
        if len(row) != len(types):
            raise ValueError(
                f"{path}:{i}: expected {len(types)} tab-separated fields, got {len(row)}"
            )
        for (name, kind), cell in zip(types, row, strict=True):
            if kind.endswith("_seq"):
                cell = cell.split(" ") if cell else []
            columns[name].append(cell)
        numbers.append(i)
    return columns, dict(types), numbers


def _recbole(root: Path, user_field="user_id", item_field="item_id") -> RawRatings:
    inters = sorted(root.glob("*.inter"))
    if len(inters) != 1:
        raise ValueError(f"expected one *.inter file in {root}, found {[p.name for p in inters]}")
    cols, _, numbers = _read_atomic(inters[0])
    for need in (user_field, item_field, "rating"):
        if need not in cols:
            raise ValueError(f"{inters[0]}: no {need!r} column (has {sorted(cols)})")
    if not numbers:
        raise ValueError(f"{inters[0]}: no ratings (only a header)")
    stamps = cols.get("timestamp", ["0"] * len(numbers))
    # any rating scale (RecBole files are not all MovieLens), but finite
    checked = [
        _rating(f"{inters[0]}:{i}", u, it, r, t, stars=False)
        for i, u, it, r, t in zip(
            numbers, cols[user_field], cols[item_field], cols["rating"], stamps, strict=True
        )
    ]
    ratings = np.array([r for r, _ in checked], np.float32)
    times = np.array([t for _, t in checked], np.int64)
    raw = RawRatings(cols[user_field], cols[item_field], ratings, times)
    for ext, key, out in (
        (".user", user_field, raw.user_features),
        (".item", item_field, raw.item_features),
    ):
        side = root / (inters[0].stem + ext)
        if side.exists():
            table, kinds, _ = _read_atomic(side)
            if key not in table:
                raise ValueError(f"{side}: no {key!r} column (has {sorted(table)})")
            ids = table.pop(key)
            for name, col in table.items():
                if "title" in name or kinds[name].startswith("float"):
                    continue  # free text and numbers are not categorical features
                out[name] = {
                    i: (v if isinstance(v, list) else [v]) for i, v in zip(ids, col, strict=True)
                }
    return raw
