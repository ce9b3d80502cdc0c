"""Criteo click logs: Kaggle (``train.txt``) and 1TB (``day_0`` .. ``day_23``).

TorchRec: ``torchrec.datasets.criteo`` (``criteo_kaggle``, ``criteo_terabyte``,
``BinaryCriteoUtils``, ``InMemoryBinaryCriteoIterDataPipe``). Keys are
``cat_0`` .. ``cat_25`` (one id each, or MLPerf-style multi-hot bags), 13
dense features (``log(x - min + 2)`` as TorchRec's npy files hold them), labels
0/1. Ids are hashed ``id % num_embeddings_per_feature[k]`` per batch, as
TorchRec's ``hashes`` argument does.

Layouts read by :func:`criteo_split`:

- npy (TorchRec's ``npy_preproc_criteo.py`` output, or :func:`preprocess_criteo`):
  ``day_{i}_dense.npy`` float32 ``[N, 13]``, ``day_{i}_sparse.npy`` int64
  ``[N, 26]``, ``day_{i}_labels.npy`` int32 ``[N, 1]`` (Kaggle: ``train_*.npy``);
- TSV: ``day_{i}`` files or ``train.txt`` (parsed into memory: convert big
  files to npy once instead).

``python -m jaxrec.datasets.criteo preprocess --input-dir D --output-dir O
[--dataset-name criteo_kaggle]`` converts TSV to npy.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .batching import Part, Table, TableDataset, resolve_part
from .criteo_index import TsvColumns, index_criteo_tsv
from .criteo_tsv import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    INT_FEATURE_COUNT,
    ParseStats,
    dense_log_transform,
    preprocess_criteo,
    read_criteo_tsv,
)
from .multi_hot import MultiHot
from .random import RandomRecDataset

# TorchRec's dlrm example defaults (Kaggle after contiguous remapping)
CRITEO_KAGGLE_NUM_EMBEDDINGS = [
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
]


class CriteoDataset(TableDataset):
    """Criteo rows (one :class:`Table` per file) -> batches of 26 hashed sparse features.

    Args:
        dense: per file ``[N, 13]`` float (already log-transformed).
        sparse: per file ``[N, 26]`` raw integer ids.
        labels: per file ``[N]`` or ``[N, 1]``.
        num_embeddings_per_feature: an int (every table) or 26 ints; ids are taken modulo.
        multi_hot: a :class:`MultiHot` expanding each id into a fixed bag.
        sources: per file, a name for error messages (default ``file {i}``).

    Batches check their rows: a non-finite dense value or a label other than 0
    or 1 raises ``ValueError`` naming the file and row (unless the data was read
    with ``has_label=False``, whose labels are -1).
    """

    def __init__(
        self,
        dense: Sequence[np.ndarray],
        sparse: Sequence[np.ndarray],
        labels: Sequence[np.ndarray],
        *,
        num_embeddings_per_feature: int | Sequence[int],
        multi_hot: MultiHot | None = None,
        sources: Sequence[str] | None = None,
    ):
        sizes = _sizes(num_embeddings_per_feature)
        dense, sparse, labels = list(dense), list(sparse), list(labels)
        if sources is None:
            sources = [f"file {i}" for i in range(len(dense))]
        self.sources = [str(x) for x in sources]
        tables = []
        for src, d, s, y in zip(self.sources, dense, sparse, labels, strict=True):
            _check_file({"dense": d, "sparse": s, "labels": y}, dict.fromkeys(_PARTS, src))
            tables.append(Table(d, [s[:, k] for k in range(CAT_FEATURE_COUNT)], y))
        if multi_hot is not None and multi_hot.num_embeddings_per_feature != sizes:
            raise ValueError("multi_hot was built for other num_embeddings_per_feature")
        self._sparse = list(sparse)
        self.multi_hot = multi_hot
        self.parse_stats: list[ParseStats] = []
        self.unlabeled = False  # True for has_label=False data (labels -1)
        # for batch errors: the file of each part and the row of the table's first row in it
        self._files = [dict.fromkeys(_PARTS, src) for src in self.sources]
        self._first_rows = [0] * len(tables)
        sizes_per_key = multi_hot.multi_hot_sizes if multi_hot else [1] * CAT_FEATURE_COUNT
        super().__init__(
            tables,
            keys=DEFAULT_CAT_NAMES,
            num_embeddings_per_feature=sizes,
            max_ids_per_sample=dict(zip(DEFAULT_CAT_NAMES, sizes_per_key, strict=True)),
        )

    @classmethod
    def from_npy(
        cls,
        prefixes: Sequence[str | os.PathLike],
        *,
        num_embeddings_per_feature: int | Sequence[int],
        multi_hot: MultiHot | None = None,
        mmap: bool = True,
        part: Part | None = None,
    ) -> CriteoDataset:
        """From ``{prefix}_dense.npy`` / ``_sparse.npy`` / ``_labels.npy`` per file.

        ``mmap`` memory-maps the files (rows are read when batched; always so
        with a ``part``, whose batches then read only that part's rows).
        """
        parts = [load_npy(p, mmap=mmap or part is not None) for p in prefixes]
        data = cls(
            *zip(*parts, strict=True),
            num_embeddings_per_feature=num_embeddings_per_feature,
            multi_hot=multi_hot,
            sources=[str(p) for p in prefixes],
        )
        data._files = [_npy_names(p) for p in prefixes]
        data.part = None if part is None else resolve_part(part)
        return data

    @classmethod
    def from_tsv(
        cls,
        paths: Sequence[str | os.PathLike],
        *,
        num_embeddings_per_feature: int | Sequence[int],
        multi_hot: MultiHot | None = None,
        has_label: bool = True,
        on_error: str = "raise",
        part: Part | None = None,
    ) -> CriteoDataset:
        """Parses TSV files into memory with TorchRec's npy preprocessing (per file).

        With a ``part`` (``Part(index, count)``) the files are read once but only
        indexed (``jaxrec.datasets.criteo_index``): each batch parses its own rows,
        so the dataset holds no parsed rows beyond the batch being built, and the
        batches default to that part. ``parse_stats`` holds one
        :class:`ParseStats` per file (lines, skipped).
        """
        stats = [ParseStats() for _ in paths]
        parts = [
            _open_tsv(p, part, has_label=has_label, on_error=on_error, stats=st)
            for p, st in zip(paths, stats, strict=True)
        ]
        data = cls(
            *zip(*parts, strict=True),
            num_embeddings_per_feature=num_embeddings_per_feature,
            multi_hot=multi_hot,
            sources=[str(p) for p in paths],
        )
        data.parse_stats = stats
        data.unlabeled = not has_label
        data.part = None if part is None else resolve_part(part)
        return data

    def _take(self, rows: np.ndarray):
        b = len(rows)
        part = np.searchsorted(self._starts, rows, side="right") - 1
        dense = np.empty((b, INT_FEATURE_COUNT), np.float32)
        labels = np.empty(b, np.float32)
        sparse = np.empty((b, CAT_FEATURE_COUNT), np.int64)
        for t in np.unique(part):
            mask = part == t
            local = rows[mask] - self._starts[t]
            order = np.argsort(local)  # sorted reads from memory-mapped files
            inv = np.argsort(order)
            rows_t = local[order]
            d = np.asarray(self.tables[t].dense[rows_t])
            y = np.asarray(self.tables[t].labels[rows_t], np.float32).reshape(-1)
            self._check_rows(t, rows_t + self._first_rows[t], d, y)
            dense[mask], labels[mask] = d[inv], y[inv]
            sparse[mask] = np.asarray(self._sparse[t][rows_t])[inv]
        sparse %= np.asarray(self.num_embeddings_per_feature)  # TorchRec's ``hashes``
        cols = []
        for k in range(CAT_FEATURE_COUNT):
            ids = sparse[:, k]
            if self.multi_hot is None:
                cols.append((ids, np.ones(b, np.int64)))
            else:
                bags = self.multi_hot.expand(k, ids)
                cols.append((bags.reshape(-1), np.full(b, bags.shape[1], np.int64)))
        return dense, labels, cols

    def _check_rows(self, t: int, rows: np.ndarray, dense: np.ndarray, labels: np.ndarray):
        """A memory-mapped file is checked as its rows are read, not all at load time."""
        bad = ~np.isfinite(dense)
        if bad.any():
            j = int(np.argmax(bad.any(axis=1)))
            raise ValueError(
                f"{self._files[t]['dense']} row {rows[j]}: non-finite dense value "
                f"{dense[j][bad[j]][0]}; fix or drop that row (dense features must be finite)"
            )
        ok = (labels == -1) if self.unlabeled else (labels == 0) | (labels == 1)
        if not ok.all():
            j = int(np.argmin(ok))
            raise ValueError(
                f"{self._files[t]['labels']} row {rows[j]}: label {labels[j]} must be "
                + ("-1 (has_label=False)" if self.unlabeled else "0 or 1")
            )


_PARTS = ("dense", "sparse", "labels")


def _npy_names(prefix) -> dict:
    return {part: f"{prefix}_{part}.npy" for part in _PARTS}


def _check_file(arrays: dict, names: dict) -> None:
    """Shapes and dtypes of one file's dense, sparse and labels; errors name the file."""
    d, s, y = arrays["dense"], arrays["sparse"], arrays["labels"]
    if np.ndim(d) != 2 or np.shape(d)[1] != INT_FEATURE_COUNT:
        raise ValueError(f"{names['dense']}: dense must be [N, 13], got shape {np.shape(d)}")
    if np.ndim(s) != 2 or np.shape(s)[1] != CAT_FEATURE_COUNT:
        raise ValueError(f"{names['sparse']}: sparse must be [N, 26], got shape {np.shape(s)}")
    if not (np.ndim(y) == 1 or (np.ndim(y) == 2 and np.shape(y)[1] == 1)):
        raise ValueError(f"{names['labels']}: labels must be [N] or [N, 1], got {np.shape(y)}")
    dtypes = {part: np.asarray(arr[:0]).dtype for part, arr in arrays.items()}
    for part, kind, what in (
        ("dense", np.floating, "float (log-transformed)"),
        ("sparse", np.integer, "integer ids"),
        ("labels", np.number, "numbers"),
    ):
        if not np.issubdtype(dtypes[part], kind):
            raise ValueError(f"{names[part]}: {part} must be {what}, got dtype {dtypes[part]}")
    n = len(d)
    for part, arr in (("sparse", s), ("labels", y)):
        if len(arr) != n:
            raise ValueError(f"{names[part]}: {len(arr)} rows, but {names['dense']} has {n}")
    if n == 0:
        raise ValueError(f"{names['dense']}: no rows (an empty file; drop it or regenerate it)")


def _sizes(n: int | Sequence[int]) -> list[int]:
    sizes = [int(n)] * CAT_FEATURE_COUNT if isinstance(n, int | np.integer) else [int(x) for x in n]
    if len(sizes) != CAT_FEATURE_COUNT or min(sizes) < 1:
        raise ValueError(f"num_embeddings_per_feature must be one int or 26 ints >= 1, got {n}")
    return sizes


def load_npy(prefix: str | os.PathLike, *, mmap: bool = True) -> tuple[np.ndarray, ...]:
    """``(dense, sparse, labels)`` of one file in TorchRec's npy layout.

    Raises ``ValueError`` naming the file when one is truncated or corrupt, has
    the wrong shape or dtype, a row count unlike the others', or no rows.
    """
    out, names = {}, {}
    for part in _PARTS:
        path = names[part] = f"{prefix}_{part}.npy"
        if not os.path.exists(path):
            raise FileNotFoundError(f"missing {path} (TorchRec's npy layout: prefix_{part}.npy)")
        try:
            out[part] = np.load(path, mmap_mode="r" if mmap else None)
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(
                f"{path}: not a readable .npy file (truncated or corrupt?): {e}; "
                "regenerate it (python -m jaxrec.datasets.criteo preprocess)"
            ) from None
    _check_file(out, names)
    return out["dense"], out["sparse"], out["labels"]


def load_tsv(path: str | os.PathLike, **kwargs) -> tuple[np.ndarray, ...]:
    """``(dense, sparse, labels)`` of one TSV file, preprocessed like TorchRec's npy files."""
    labels, dense, sparse = read_criteo_tsv(path, **kwargs)
    return dense_log_transform(dense), sparse, labels


def _open_tsv(path, part: Part | None, **kwargs) -> tuple:
    """:func:`load_tsv`'s arrays, or with a ``part`` array-likes parsing rows on demand."""
    if part is None:
        return load_tsv(path, **kwargs)
    index = index_criteo_tsv(path, **kwargs)
    return tuple(TsvColumns(index, what) for what in ("dense", "sparse", "labels"))


def criteo_split(
    data_dir: str | os.PathLike,
    *,
    num_embeddings: int | Sequence[int] = 100_000,
    multi_hot: MultiHot | None = None,
    on_error: str = "raise",
    part: Part | None = None,
) -> tuple[CriteoDataset, CriteoDataset]:
    """``(train, eval)`` from a folder of npy or TSV files (npy preferred when both exist).

    Several days: train on all but the last day, evaluate on the first half of
    the last day (TorchRec's ``stage="val"``). One file (Kaggle's ``train.txt``
    or a single day): the first 6/7 of its rows train, the last 1/7 evaluate
    (Kaggle's seven days, the last held out). TSV files are parsed into memory.

    ``part``: the ``Part(index, count)`` of the batch stream this process reads
    (with several processes, ``Part(jax.process_index(), jax.process_count())``,
    or its devices' parts of the job's world). Then no file is held in memory:
    npy files are memory-mapped and TSV files indexed (each batch parses its
    rows), so a process reads only the rows of the batches it asks for, and
    ``batches()`` defaults to that part.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no Criteo data in {root}: not a directory")
    npy_days = _numbered(root, r"day_(\d+)_dense\.npy")
    tsv_days = _numbered(root, r"day_(\d+)")
    stats: list[ParseStats] = []
    if npy_days:
        paths = [str(p)[: -len("_dense.npy")] for p in npy_days]
        files = [load_npy(p) for p in paths]
    elif (root / "train_dense.npy").exists():
        paths = [str(root / "train")]
        files = [load_npy(paths[0])]
    elif tsv_days or (root / "train.txt").exists():
        paths = tsv_days or [root / "train.txt"]
        stats = [ParseStats() for _ in paths]
        files = [
            _open_tsv(p, part, on_error=on_error, stats=st)
            for p, st in zip(paths, stats, strict=True)
        ]
    else:
        raise FileNotFoundError(
            f"no Criteo data in {root}: expected day_{{i}}_dense.npy (+ _sparse, _labels), "
            "train_dense.npy, day_{i} TSV files or train.txt"
        )
    names = [str(p) for p in paths]
    if len(files) > 1:
        last = files[-1]
        half = (len(last[0]) + 1) // 2
        train_files, eval_files = files[:-1], [tuple(a[:half] for a in last)]
        train_names, eval_names = names[:-1], [f"{names[-1]} (first half)"]
    else:
        n = len(files[0][0])
        if n < 7:
            raise ValueError(
                f"{names[0]} has {n} rows: too few to hold out the last 1/7 for evaluation "
                "(need at least 7)"
            )
        cut = n - n // 7
        train_files = [tuple(a[:cut] for a in files[0])]
        eval_files = [tuple(a[cut:] for a in files[0])]
        train_names, eval_names = names, [f"{names[0]} (last 1/7)"]
    kw = dict(num_embeddings_per_feature=num_embeddings, multi_hot=multi_hot)
    train = CriteoDataset(*zip(*train_files, strict=True), sources=train_names, **kw)
    test = CriteoDataset(*zip(*eval_files, strict=True), sources=eval_names, **kw)
    if not stats:  # npy: batch errors name the npy file and the row in it
        train._files = [_npy_names(p) for p in names[: len(train_files)]]
        test._files = [_npy_names(names[-1])]
        if len(files) == 1:
            test._first_rows = [len(files[0][0]) - len(eval_files[0][0])]
    train.parse_stats = test.parse_stats = stats
    train.part = test.part = None if part is None else resolve_part(part)
    return train, test


def _numbered(root: Path, pattern: str) -> list[Path]:
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := re.fullmatch(pattern, p.name))]
    return [p for _, p in sorted(found)]


# ----- synthetic Criteo-like data -----
def synthetic_criteo(
    num_samples: int,
    *,
    seed: int = 0,
    data_stream: int = 0,
    num_embeddings_per_feature: Sequence[int] | None = None,
    multi_hot_sizes: Sequence[int] | None = None,
    alpha: float | None = 1.05,
) -> RandomRecDataset:
    """Criteo's schema (``cat_0..cat_25``, 13 dense) with random data and a planted model.

    Table sizes default to Kaggle's capped at 1,000 rows; ids are Zipf(``alpha``);
    ``multi_hot_sizes`` gives fixed bags instead of one id per feature. Labels
    follow :class:`~jaxrec.datasets.RandomRecDataset`'s planted model (``seed``),
    so ``reference_metrics()`` gives the best reachable AUC. Dense features
    are standard normal (not log counts).
    """
    sizes = num_embeddings_per_feature or [min(n, 1000) for n in CRITEO_KAGGLE_NUM_EMBEDDINGS]
    bags = list(multi_hot_sizes) if multi_hot_sizes is not None else [1] * CAT_FEATURE_COUNT
    return RandomRecDataset(
        DEFAULT_CAT_NAMES,
        num_samples,
        hash_sizes=list(sizes),
        ids_per_features=bags,
        min_ids_per_features=bags,
        num_dense=INT_FEATURE_COUNT,
        alpha=alpha,
        manual_seed=seed,
        data_stream=data_stream,
        bias_scale=0.25,
        intercept=-1.5,
    )


def synthetic_criteo_split(
    num_train: int, num_eval: int, *, seed: int = 0, **kwargs
) -> tuple[RandomRecDataset, RandomRecDataset]:
    """Train and eval :func:`synthetic_criteo` sets drawn from one planted model."""
    train = synthetic_criteo(num_train, seed=seed, data_stream=0, **kwargs)
    return train, synthetic_criteo(num_eval, seed=seed, data_stream=1, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxrec.datasets.criteo")
    sub = p.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("preprocess", help="TSV -> TorchRec's npy layout")
    pre.add_argument("--input-dir", required=True)
    pre.add_argument("--output-dir", required=True)
    pre.add_argument(
        "--dataset-name", default="criteo_1tb", choices=("criteo_1tb", "criteo_kaggle")
    )
    pre.add_argument("--skip-malformed", action="store_true", help="skip and count bad lines")
    args = p.parse_args(argv)
    on_error = "skip" if args.skip_malformed else "raise"
    preprocess_criteo(args.input_dir, args.output_dir, args.dataset_name, on_error=on_error)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
