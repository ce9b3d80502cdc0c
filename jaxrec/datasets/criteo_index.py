"""Criteo TSV rows read on demand: a line index, and each batch's lines parsed as it is built.

A dataset opened for one part of its batch stream (``part=``) must not hold
every parsed row. Opening a TSV file still reads all of it once (every line is
checked, skipped lines counted, and TorchRec's dense transform needs the
file's minimum), but keeps only where each valid line starts (12 bytes a row,
against 264 parsed). A batch's rows are then read back (one ``pread`` per run
of consecutive lines) and parsed again: each epoch costs a parse of the rows
the part reads. Convert big files to npy (``preprocess_criteo``) to skip that.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from .criteo_tsv import (
    CAT_FEATURE_COUNT,
    INT_FEATURE_COUNT,
    ParseStats,
    _chunks,
    _parse_chunk,
    _parse_lines,
    dense_log_transform,
)


@dataclasses.dataclass(eq=False)
class TsvIndex:
    """Where each valid line of a Criteo TSV file starts, and the file's dense bounds.

    Attributes:
        path: the file.
        starts: ``[N]`` int64 byte offset of valid line ``i``.
        lengths: ``[N]`` int32 its length in bytes (with its line end).
        bounds: ``(min, max)`` of the file's dense integers (the log transform's).
        has_label: whether lines start with a label.
        rows_parsed: rows parsed since opening (a repeated read of the same rows counts once).
    """

    path: str
    starts: np.ndarray
    lengths: np.ndarray
    bounds: tuple[int, int]
    has_label: bool = True
    rows_parsed: int = 0
    # (rows key, (dense, sparse, labels)) of the last read
    _last: tuple[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = dataclasses.field(
        default=None, repr=False
    )

    def __len__(self) -> int:
        return len(self.starts)

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(dense f32 [b, 13], sparse int64 [b, 26], labels int32 [b])`` of ``rows``.

        The last read is kept, so a batch's dense, sparse and labels parse once.
        """
        rows = np.asarray(rows, np.int64).reshape(-1)
        if not len(rows):
            shapes = ((0, INT_FEATURE_COUNT), (0, CAT_FEATURE_COUNT), (0,))
            dense, sparse, labels = (np.zeros(s, d) for s, d in zip(shapes, _DTYPES, strict=True))
            return dense, sparse, labels
        key = rows.tobytes()
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        order = np.argsort(rows, kind="stable")
        srt = rows[order]
        lines = self._lines(srt)
        out = _parse_chunk(lines, self.has_label)
        if out is None:  # valid when indexed: only a file changed since then gets here
            fields = INT_FEATURE_COUNT + CAT_FEATURE_COUNT + int(self.has_label)
            *out, _ = _parse_lines(lines, fields, self.has_label, self.path, 1, "raise", None)
        labels, dense, sparse = out
        inv = np.empty_like(order)
        inv[order] = np.arange(len(order))
        got = (dense_log_transform(dense, bounds=self.bounds)[inv], sparse[inv], labels[inv])
        self.rows_parsed += len(rows)
        self._last = (key, got)
        return got

    def _lines(self, rows: np.ndarray) -> list[bytes]:
        starts, lengths = self.starts[rows], self.lengths[rows].astype(np.int64)
        ends = starts + lengths
        # runs of lines that follow each other in the file: one read each
        new = np.ones(len(rows), bool)
        new[1:] = starts[1:] != ends[:-1]
        firsts = np.flatnonzero(new)
        lasts = np.append(firsts[1:], len(rows)) - 1
        lines = []
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for a, b in zip(firsts.tolist(), lasts.tolist(), strict=True):
                base = int(starts[a])
                text = os.pread(fd, int(ends[b]) - base, base)
                offs = (starts[a : b + 1] - base).tolist()
                offs.append(len(text))
                lines.extend(text[offs[i] : offs[i + 1]] for i in range(len(offs) - 1))
        finally:
            os.close(fd)
        return lines


def index_criteo_tsv(
    path: str | os.PathLike,
    *,
    has_label: bool = True,
    on_error: str = "raise",
    stats: ParseStats | None = None,
    chunk_rows: int = 8192,
) -> TsvIndex:
    """Reads ``path`` once (as :func:`~jaxrec.datasets.iter_criteo_tsv`, same errors) and
    keeps only each valid line's place and the dense bounds. ``chunk_rows`` is smaller
    than the whole load's: a parsed chunk is transient memory (~3 KB a line)."""
    starts, lengths, low, high, pos = [], [], None, None, 0
    for (_, dense, _), lines, kept in _chunks(path, has_label, chunk_rows, on_error, stats):
        size = np.fromiter(map(len, lines), np.int64, len(lines))
        first = pos + np.cumsum(size) - size
        pos += int(size.sum())
        if kept is not None:
            first, size = first[kept], size[kept]
        starts.append(first)
        lengths.append(size.astype(np.int32))
        if dense.size:
            lo, hi = int(dense.min()), int(dense.max())
            low = lo if low is None else min(low, lo)
            high = hi if high is None else max(high, hi)
    return TsvIndex(
        str(path),
        np.concatenate(starts),
        np.concatenate(lengths),
        (0, 0) if low is None or high is None else (low, high),
        has_label,
    )


_DTYPES = (np.float32, np.int64, np.int32)  # dense, sparse, labels


class TsvColumns:
    """Rows ``lo:hi`` of a :class:`TsvIndex` as one array-like: ``"dense"`` ``[n, 13]``,
    ``"sparse"`` ``[n, 26]`` (or one column of it), ``"labels"`` ``[n]``.

    Takes what :class:`~jaxrec.datasets.CriteoDataset` does to an array: an
    integer array of rows (read and parsed then), a row slice, ``[:, k]``,
    ``len``, ``shape``, ``dtype`` and ``np.asarray`` (every row).
    """

    _DTYPES = {"dense": np.float32, "sparse": np.int64, "labels": np.int32}

    def __init__(self, index: TsvIndex, what: str, lo: int = 0, hi: int | None = None, col=None):
        self.index, self.what, self.col = index, what, col
        self.lo, self.hi = lo, len(index) if hi is None else hi
        self.dtype = np.dtype(self._DTYPES[what])

    @property
    def shape(self) -> tuple[int, ...]:
        n = self.hi - self.lo
        width = {"dense": INT_FEATURE_COUNT, "sparse": CAT_FEATURE_COUNT}.get(self.what)
        return (n,) if width is None or self.col is not None else (n, width)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, key):
        if isinstance(key, tuple) and len(key) == 2 and key[0] == slice(None):
            if self.what != "sparse" or self.col is not None:
                raise IndexError(f"[:, k] takes the sparse columns, not {self.what}")
            return TsvColumns(self.index, self.what, self.lo, self.hi, int(key[1]))
        if isinstance(key, slice):
            lo, hi, step = key.indices(len(self))
            if step != 1:
                raise IndexError("TsvColumns takes row slices with step 1")
            return TsvColumns(self.index, self.what, self.lo + lo, self.lo + max(lo, hi), self.col)
        return self._read(key)

    def _read(self, key) -> np.ndarray:
        """The values of rows ``key`` (an int array or anything numpy makes one of)."""
        rows = np.asarray(key, np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows out of range [0, {len(self)})")
        dense, sparse, labels = self.index.read(rows + self.lo)
        got = {"dense": dense, "sparse": sparse, "labels": labels}[self.what]
        return got if self.col is None else got[:, self.col]

    def __array__(self, dtype=None, copy=None):
        got = self._read(np.arange(len(self))) if len(self) else np.zeros(self.shape, self.dtype)
        return got if dtype is None else got.astype(dtype)
