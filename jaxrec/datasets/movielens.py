"""MovieLens as click-style data: ``label = rating >= 4``, user/item ids and side features.

TorchRec: ``torchrec.datasets.movielens`` (``movielens_20m``, ``movielens_25m``).
Reads ml-100k, ml-1m, ml-20m/25m and RecBole atomic files (see
``movielens_files``). Sparse features, in order: ``user_id``, ``item_id``, the
user side features (ml-100k/1m: ``age``, ``gender``, ``occupation``), the item
side features (``genres``, a multi-hot bag). Raw ids are remapped to
contiguous ranges in sorted order over the whole folder (train and test share
them); side-feature id 0 means "unknown". There are no dense features
(``num_dense == 0``).

Split (:func:`movielens_split`): ``"time"`` (default) puts each user's latest
``round(test_fraction * n)`` ratings (by timestamp, file order breaking ties)
in the test set; ``"random"`` puts each rating there with probability
``test_fraction`` (``np.random.default_rng(seed)``).

``python -m jaxrec.datasets.movielens fetch [--cache-dir DIR]`` downloads
ml-100k (RecBole's atomic files, from the ``recbole==1.2.1`` wheel on PyPI)
into ``~/.cache/jaxrec/ml-100k``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .batching import Part, Ragged, Table, TableDataset, resolve_part
from .movielens_files import RawRatings, read_movielens

RECBOLE_VERSION = "1.2.1"
ML100K_IN_WHEEL = "recbole/dataset_example/ml-100k/"
ML100K_FILES = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")


class MovieLensDataset(TableDataset):
    """MovieLens ratings as a :class:`TableDataset`; ``vocab[key]`` maps raw tokens to ids."""

    vocab: dict
    format: str
    ratings: np.ndarray  # [N] the raw ratings behind the labels


def load_movielens(
    path: str | os.PathLike, *, threshold: float = 4.0, part: Part | None = None
) -> MovieLensDataset:
    """Every rating of a MovieLens folder as one dataset (label ``rating >= threshold``).

    ``part``: see :func:`movielens_split`.
    """
    raw = read_movielens(path)
    cols, meta = _encode(raw)
    return _dataset(cols, meta, raw, threshold, np.arange(len(raw.ratings)), part)


def movielens_split(
    path: str | os.PathLike,
    *,
    split: str = "time",
    test_fraction: float = 0.2,
    seed: int = 0,
    threshold: float = 4.0,
    part: Part | None = None,
) -> tuple[MovieLensDataset, MovieLensDataset]:
    """``(train, test)`` datasets sharing one id mapping; see the module docstring.

    ``part``: the ``Part(index, count)`` of the batch stream this process reads
    (``batches()`` then defaults to it). The whole folder is still read (the id
    mapping sorts every id, the time split ranks each user's every rating), and
    a shuffled part's rows change every epoch, so each rating's user and item
    ids stay (int32); the side features (age, gender, occupation, genres) are
    held once per user or item and looked up per batch instead of per rating.
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    raw = read_movielens(path)
    cols, meta = _encode(raw)
    n = len(raw.ratings)
    if split == "time":
        user = cols[0]
        assert isinstance(user, np.ndarray)  # _encode's first column: the user ids
        order = np.lexsort((np.arange(n), raw.timestamps, user))  # by user, then time, then file
        counts = np.bincount(user)
        start = np.concatenate([[0], np.cumsum(counts)])[user[order]]
        rank = np.arange(n) - start  # position within the user's history
        n_test = np.round(counts * test_fraction).astype(np.int64)[user[order]]
        is_test = np.empty(n, bool)
        is_test[order] = rank >= counts[user[order]] - n_test
    elif split == "random":
        is_test = np.random.default_rng(seed).random(n) < test_fraction
    else:
        raise ValueError(f"split must be 'time' or 'random', got {split!r}")
    for side, mask in (("train", ~is_test), ("test", is_test)):
        if not mask.any():
            raise ValueError(
                f"the {side} split of {path} is empty ({n} ratings, split={split!r}, "
                f"test_fraction={test_fraction}); change test_fraction or use the other split"
            )
    rows = np.arange(n)
    train = _dataset(cols, meta, raw, threshold, rows[~is_test], part)
    return train, _dataset(cols, meta, raw, threshold, rows[is_test], part)


def _vocab(tokens) -> dict:
    return {t: i for i, t in enumerate(sorted(set(tokens), key=_sort_key))}


def _sort_key(t: str):
    # numeric ids in numeric order; isdigit() alone also takes "²", which int() refuses
    return (0, int(t), "") if t.isascii() and t.isdigit() else (1, 0, t)


def _encode(raw: RawRatings):
    """Per-rating columns and ``(keys, sizes, vocab)``: ``[N]`` user and item ids, then
    the side features, each held once per user or item (``_Owned``, :class:`OwnedRagged`)."""
    users, items = _vocab(raw.users), _vocab(raw.items)
    u = np.fromiter((users[x] for x in raw.users), np.int64, len(raw.users))
    it = np.fromiter((items[x] for x in raw.items), np.int64, len(raw.items))
    keys, sizes, vocab = ["user_id", "item_id"], [len(users), len(items)], {}
    cols: list[np.ndarray | _Owned | OwnedRagged] = [u, it]  # ids, then side features
    vocab["user_id"], vocab["item_id"] = users, items
    clash = set(raw.user_features) & set(raw.item_features)
    for side, owners, rows, prefix in (
        (raw.user_features, users, u, "user_"),
        (raw.item_features, items, it, "item_"),
    ):
        for name, by_owner in side.items():
            key = prefix + name if name in clash else name
            voc = {
                t: i + 1
                for i, t in enumerate(
                    sorted({t for v in by_owner.values() for t in v}, key=_sort_key)
                )
            }
            per_owner = [[voc[t] for t in by_owner.get(o, [])] for o in owners]
            if all(len(v) == 1 for v in by_owner.values()):  # one token each: a plain id column
                codes = np.array([v[0] if v else 0 for v in per_owner], np.int64)
                cols.append(_Owned(codes, rows))
            else:
                bags = Ragged.from_lengths(
                    np.array([t for v in per_owner for t in v], np.int64),
                    [len(v) for v in per_owner],
                )
                cols.append(OwnedRagged(bags.values, bags.offsets, rows))
            keys.append(key)
            sizes.append(len(voc) + 1)
            vocab[key] = voc
    return cols, (keys, sizes, vocab)


def _dataset(cols, meta, raw, threshold, rows, part) -> MovieLensDataset:
    """The dataset of ``rows``; with a ``part``, side features stay per user and item."""
    keys, sizes, vocab = meta
    if part is None:  # every column per rating
        sparse = [
            Ragged.from_lengths(*c.take(rows)) if isinstance(c, Ragged) else c[rows] for c in cols
        ]
    else:  # ids per rating (int32), side features looked up per batch
        small = [c[rows].astype(np.int32) for c in cols[:2]]
        sparse = small + [c.rows(small[c.owner is cols[1]]) for c in cols[2:]]
    labels = (raw.ratings[rows] >= threshold).astype(np.float32)
    max_ids = {
        k: max(c.max_length(), 1) for k, c in zip(keys, cols, strict=True) if isinstance(c, Ragged)
    }
    data = MovieLensDataset(
        Table(np.zeros((len(rows), 0), np.float32), sparse, labels),
        keys=keys,
        num_embeddings_per_feature=sizes,
        max_ids_per_sample=max_ids,  # the whole folder's longest bag: equal for train and test
    )
    data.vocab, data.format = vocab, raw.format
    data.ratings = raw.ratings[rows]
    data.part = None if part is None else resolve_part(part)
    return data


class _Owned:
    """A side feature of the user or item of each row: ``codes[owner[rows]]``, ``[N]``."""

    def __init__(self, codes: np.ndarray, owner: np.ndarray):
        self.codes, self.owner = codes, owner
        self.shape, self.ndim, self.dtype = owner.shape, 1, codes.dtype

    def __len__(self) -> int:
        return len(self.owner)

    def __getitem__(self, rows):
        return self.codes[self.owner[rows]]

    def rows(self, owner: np.ndarray) -> _Owned:
        return _Owned(self.codes, owner)


@dataclasses.dataclass(frozen=True)
class OwnedRagged(Ragged):
    """A bag per user or item (``values``/``offsets`` per owner) read per row: row ``i``
    holds owner ``owner[i]``'s bag. Held once per owner, not once per rating."""

    owner: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.owner)

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return super().take(self.owner[rows])

    def rows(self, owner: np.ndarray) -> OwnedRagged:
        return OwnedRagged(self.values, self.offsets, owner)


# ----- fetch -----
def default_cache_dir() -> Path:
    return Path(os.environ.get("JAXREC_CACHE", Path.home() / ".cache" / "jaxrec"))


def extract_ml100k(wheel: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    """Extracts ``recbole/dataset_example/ml-100k/*`` of a wheel into ``cache_dir/ml-100k``."""
    target = Path(cache_dir) / "ml-100k"
    with zipfile.ZipFile(wheel) as zf:
        members = [
            m for m in zf.namelist() if m.startswith(ML100K_IN_WHEEL) and not m.endswith("/")
        ]
        missing = [f for f in ML100K_FILES if ML100K_IN_WHEEL + f not in members]
        if missing:
            raise ValueError(f"{wheel} has no {ML100K_IN_WHEEL}{{{', '.join(missing)}}}")
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".ml-100k-", dir=cache_dir))
        try:
            for m in members:
                name = m[len(ML100K_IN_WHEEL) :]
                if "/" in name or name in ("", ".", ".."):
                    continue  # only the folder's own files
                (staging / name).write_bytes(zf.read(m))
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)  # appears whole or not at all
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _pip_download(dest: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"recbole=={RECBOLE_VERSION}",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--dest",
        dest,
    ]
    # pip's own output is captured (kept off the caller's stdout) and shown on failure.
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise OSError(f"pip download recbole=={RECBOLE_VERSION} failed:\n{tail}")


def fetch_movielens_100k(
    cache_dir: str | os.PathLike | None = None, *, download=_pip_download
) -> Path:
    """``cache_dir/ml-100k`` (default ``~/.cache/jaxrec``), downloading RecBole's copy if absent.

    Idempotent: a complete folder is returned as is. The download runs
    ``pip download recbole==1.2.1 --no-deps`` into a temporary folder and keeps
    only ``recbole/dataset_example/ml-100k/*`` from the wheel.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / "ml-100k"
    if all((target / f).exists() for f in ML100K_FILES):
        return target
    with tempfile.TemporaryDirectory(prefix="jaxrec-recbole-") as tmp:
        download(tmp)
        wheels = sorted(Path(tmp).glob("recbole-*.whl"))
        if not wheels:
            raise FileNotFoundError(f"pip download left no recbole wheel in {tmp}")
        return extract_ml100k(wheels[0], cache)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxrec.datasets.movielens")
    sub = p.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download ml-100k (RecBole atomic files)")
    fetch.add_argument("--cache-dir", help="default: ~/.cache/jaxrec")
    args = p.parse_args(argv)
    path = fetch_movielens_100k(args.cache_dir)
    data = load_movielens(path)
    print(f"{path}: {data.num_rows} ratings, positive rate {data.labels().mean():.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
