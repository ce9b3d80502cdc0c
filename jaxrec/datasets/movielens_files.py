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
import os
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


def _rows(path: Path, sep: str, fields: int | None, encoding: str, skip_header=False):
    """``(line number, fields)`` per non-empty line; a wrong field count names file and line."""
    with open(path, encoding=encoding, newline="") as f:
        for i, line in enumerate(f, 1):
            if skip_header and i == 1:
                continue
            line = line.rstrip("\r\n")
            if not line:
                continue
            row = line.split(sep)
            if fields is not None and len(row) != fields:
                raise ValueError(
                    f"{path}:{i}: expected {fields} fields separated by {sep!r}, got {len(row)}"
                )
            yield i, row


def _ratings(path, sep, encoding, skip_header=False) -> RawRatings:
    users, items, ratings, times = [], [], [], []
    for i, (u, it, r, t) in _rows(path, sep, 4, encoding, skip_header):
        try:
            ratings.append(float(r))
            times.append(int(float(t)))
        except ValueError:
            raise ValueError(
                f"{path}:{i}: rating {r!r} / timestamp {t!r} are not numbers"
            ) from None
        users.append(u)
        items.append(it)
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
        with open(movies, encoding="utf-8", newline="") as f:
            for i, row in enumerate(csv.reader(f), 1):
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
    columns: dict[str, list] = {}
    types = []
    with open(path, encoding="utf-8", newline="") as f:
        header = f.readline().rstrip("\r\n").split("\t")
        for h in header:
            name, _, kind = h.partition(":")
            if kind not in ("token", "token_seq", "float", "float_seq"):
                raise ValueError(
                    f"{path}:1: header field {h!r} needs a type: name:token, "
                    "name:token_seq, name:float or name:float_seq"
                )
            columns[name] = []
            types.append((name, kind))
        for i, line in enumerate(f, 2):
            line = line.rstrip("\r\n")
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
    return columns, dict(types)


def _recbole(root: Path, user_field="user_id", item_field="item_id") -> RawRatings:
    inters = sorted(root.glob("*.inter"))
    if len(inters) != 1:
        raise ValueError(f"expected one *.inter file in {root}, found {[p.name for p in inters]}")
    cols, _ = read_atomic(inters[0])
    for need in (user_field, item_field, "rating"):
        if need not in cols:
            raise ValueError(f"{inters[0]}: no {need!r} column (has {sorted(cols)})")
    n = len(cols[user_field])
    try:
        ratings = np.array(cols["rating"], np.float32)
        times = np.array(cols.get("timestamp", np.zeros(n)), np.float64).astype(np.int64)
    except ValueError:
        raise ValueError(f"{inters[0]}: rating and timestamp must be numbers") from None
    raw = RawRatings(cols[user_field], cols[item_field], ratings, times)
    for ext, key, out in (
        (".user", user_field, raw.user_features),
        (".item", item_field, raw.item_features),
    ):
        side = root / (inters[0].stem + ext)
        if side.exists():
            table, kinds = read_atomic(side)
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
