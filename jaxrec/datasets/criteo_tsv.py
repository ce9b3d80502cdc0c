"""Criteo TSV files: streaming parser and TorchRec's TSV -> npy conversion.

A line is ``label \\t 13 integers \\t 26 hex strings`` (the Kaggle ``test.txt``
has no label). As in TorchRec's ``BinaryCriteoUtils.tsv_to_npys``, an empty
field is 0 (dense and categorical alike) and categoricals are parsed as base
16. Unlike TorchRec (whose ``safe_cast`` silently turns bad text into 0 and
whose CSV reader accepts short rows), a malformed line raises
:class:`CriteoParseError` naming the file and line, or with ``on_error="skip"``
is skipped and counted in :class:`ParseStats`. Malformed: a non-ASCII byte, a
field count other than 40 (39 without labels), a label other than ``0``/``1``,
a dense field other than ``-?[0-9]+``, a categorical with a non-hex digit
(Python's ``int()`` would also take spaces, ``+``, ``_``, ``0x`` and non-ASCII
digits), or a value beyond int64. An empty file, or one whose every line was
skipped, raises too.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

INT_FEATURE_COUNT = 13
CAT_FEATURE_COUNT = 26
DAYS = 24
DEFAULT_LABEL_NAME = "label"
DEFAULT_INT_NAMES = [f"int_{i}" for i in range(INT_FEATURE_COUNT)]
DEFAULT_CAT_NAMES = [f"cat_{i}" for i in range(CAT_FEATURE_COUNT)]


class CriteoParseError(ValueError):
    """A malformed Criteo line; the message names the file and the 1-based line number."""


@dataclasses.dataclass
class ParseStats:
    """Lines read and skipped (``on_error="skip"``), with the first few reasons."""

    lines: int = 0
    skipped: int = 0
    examples: list = dataclasses.field(default_factory=list)


def iter_criteo_tsv(
    path: str | os.PathLike,
    *,
    has_label: bool = True,
    chunk_rows: int = 65_536,
    on_error: str = "raise",
    stats: ParseStats | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Streams ``(labels int32 [n], dense int64 [n, 13], sparse int64 [n, 26])`` chunks.

    Args:
        path: a Criteo TSV file (``day_3``, ``train.txt``, ...).
        has_label: False for Kaggle's ``test.txt`` (labels are then -1, as TorchRec).
        chunk_rows: lines per chunk.
        on_error: ``"raise"`` (default) or ``"skip"`` (count in ``stats``).
        stats: filled with line and skip counts when given.

    Raises:
        CriteoParseError: a malformed line (``on_error="raise"``), an empty
            file, or a file with no valid line.
    """
    for out, _lines, _kept in _chunks(path, has_label, chunk_rows, on_error, stats):
        if len(out[0]):
            yield out


def _chunks(path, has_label, chunk_rows, on_error, stats):
    """Per chunk: ``((labels, dense, sparse), lines, kept)``, ``kept`` the valid lines'
    positions in ``lines`` (None: all); the file-level errors of :func:`iter_criteo_tsv`."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    stats = ParseStats() if stats is None else stats
    fields = INT_FEATURE_COUNT + CAT_FEATURE_COUNT + int(has_label)
    lines_before, skipped_before, rows = stats.lines, stats.skipped, 0
    with open(path, "rb") as f:  # bytes: a bad byte is a malformed line, not a UnicodeDecodeError
        first = 1
        while True:
            lines = [line for _, line in zip(range(chunk_rows), f, strict=False)]
            if not lines:
                break
            stats.lines += len(lines)
            out, kept = _parse_chunk(lines, has_label), None
            if out is None:  # something is wrong: find it line by line
                *parsed, kept = _parse_lines(lines, fields, has_label, path, first, on_error, stats)
                out = (parsed[0], parsed[1], parsed[2])
            first += len(lines)
            rows += len(out[0])
            yield out, lines, kept
    if stats.lines == lines_before:
        raise CriteoParseError(f"{path}: empty file (expected one sample per line)")
    if rows == 0:
        raise CriteoParseError(
            f"{path}: no valid lines ({stats.skipped - skipped_before} of "
            f"{stats.lines - lines_before} skipped as malformed)"
        )


def read_criteo_tsv(path: str | os.PathLike, **kwargs) -> tuple[np.ndarray, ...]:
    """The whole file: ``(labels [N], dense [N, 13], sparse [N, 26])`` (:func:`iter_criteo_tsv`)."""
    chunks = list(iter_criteo_tsv(path, **kwargs))
    return tuple(np.concatenate(parts) for parts in zip(*chunks, strict=True))


# The accepted text of each field (an empty field is 0): stricter than Python's int(),
# which also takes spaces, "+", "_", "0x" and non-ASCII digits.
_LABEL = rb"[01]?+"  # possessive (``?+``, ``*+``): no backtracking, 4x faster on a chunk
_DENSE = rb"(?:-?[0-9]+)?+"
_CAT = rb"[0-9A-Fa-f]*+"
_DENSE_RE = re.compile(_DENSE.decode())
_CAT_RE = re.compile(_CAT.decode())


def _chunk_pattern(has_label: bool) -> re.Pattern:
    fields = ([_LABEL] if has_label else []) + [_DENSE] * INT_FEATURE_COUNT
    line = b"\t".join(fields + [_CAT] * CAT_FEATURE_COUNT)
    return re.compile(b"(?:%s\r*+\n)*+(?:%s\r*+)?+" % (line, line))


_CHUNK_RE = {True: _chunk_pattern(True), False: _chunk_pattern(False)}


def _parse_chunk(lines, has_label) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The chunk parsed at numpy speed, or None when any line is malformed."""
    text = b"".join(lines)
    if not _CHUNK_RE[has_label].fullmatch(text):  # one C call checks every field
        return None
    rows = [line.rstrip("\r").split("\t") for line in text.decode("ascii").split("\n")]
    if len(rows) > len(lines):  # the text ended with a newline
        rows.pop()
    arr = np.array(rows)
    arr[arr == ""] = "0"
    lab = int(has_label)
    try:  # only values beyond int64 can fail here
        labels = arr[:, 0].astype(np.int32) if has_label else np.full(len(rows), -1, np.int32)
        dense = arr[:, lab : lab + INT_FEATURE_COUNT].astype(np.int64)
        cats = arr[:, lab + INT_FEATURE_COUNT :].ravel().tolist()
        sparse = np.array([int(x, 16) for x in cats], np.int64).reshape(len(rows), -1)
    except OverflowError:
        return None
    return labels, dense, sparse


def _parse_lines(lines, fields, has_label, path, first, on_error, stats):
    labels, dense, sparse, kept = [], [], [], []
    for i, line in enumerate(lines):
        try:
            lab, d, s = _parse_line(line, fields, has_label)
        except ValueError as e:
            msg = f"{path}:{first + i}: {e}"
            if on_error == "raise":
                raise CriteoParseError(
                    msg + " (on_error='skip' skips and counts such lines)"
                ) from None
            stats.skipped += 1
            if len(stats.examples) < 5:
                stats.examples.append(msg)
            continue
        labels.append(lab)
        dense.append(d)
        sparse.append(s)
        kept.append(i)
    return (
        np.array(labels, np.int32),
        np.array(dense, np.int64).reshape(-1, INT_FEATURE_COUNT),
        np.array(sparse, np.int64).reshape(-1, CAT_FEATURE_COUNT),
        np.array(kept, np.int64),
    )


def _parse_line(line: bytes, fields: int, has_label: bool):
    """``(label, dense, sparse)`` of one line; ValueError saying what is wrong."""
    if not line.isascii():
        col, byte = next((j, b) for j, b in enumerate(line, 1) if b >= 0x80)
        raise ValueError(f"byte 0x{byte:02x} at column {col} is not ASCII (Criteo files are)")
    row = line.decode("ascii").rstrip("\r\n").split("\t")
    if len(row) != fields:
        raise ValueError(f"expected {fields} tab-separated fields, got {len(row)}")
    label = -1
    if has_label:
        text = row.pop(0)
        if text not in ("", "0", "1"):
            raise ValueError(f"label {text!r} must be 0 or 1")
        label = int(text or "0")
    dense = [_value(n, t, _DENSE_RE, 10) for n, t in zip(DEFAULT_INT_NAMES, row, strict=False)]
    cats = row[INT_FEATURE_COUNT:]
    sparse = [_value(n, t, _CAT_RE, 16) for n, t in zip(DEFAULT_CAT_NAMES, cats, strict=True)]
    return label, dense, sparse


def _value(name: str, text: str, pattern: re.Pattern, base: int) -> int:
    if not pattern.fullmatch(text):
        kind = "an integer" if base == 10 else "hexadecimal"
        raise ValueError(f"{name} {text!r} is not {kind}")
    value = int(text or "0", base)
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{name} {text!r} does not fit in int64")
    return value


def dense_log_transform(dense: np.ndarray, *, bounds: tuple[int, int] | None = None) -> np.ndarray:
    """TorchRec's ``tsv_to_npys`` dense transform: ``log(x - min(x) + 2)`` as float32.

    ``min`` is over the whole array (the file), not per column: TorchRec's
    quirk, kept so jaxrec's npy files equal TorchRec's. When ``x - min + 2``
    leaves int64 (values near both ends of int64) it is taken in float64
    instead of wrapping around to NaN. ``bounds``: the file's ``(min, max)``
    when ``dense`` is only some of its rows.
    """
    dense = np.asarray(dense, np.int64)
    if dense.size == 0:
        return dense.astype(np.float32)
    low, high = (int(dense.min()), int(dense.max())) if bounds is None else bounds
    if high - low + 2 < 2**63 and low - 2 >= -(2**63):
        return np.log(dense - (low - 2), dtype=np.float32)  # TorchRec's integer arithmetic
    # float64 keeps x - min >= 0 (rounding is monotone) and is exact to ~1e-16 relative
    return np.log(dense.astype(np.float64) - float(low) + 2.0).astype(np.float32)


def tsv_to_npys(
    in_file: str | os.PathLike,
    out_dense_file: str | os.PathLike,
    out_sparse_file: str | os.PathLike,
    out_labels_file: str | os.PathLike,
    dataset_name: str = "criteo_1tb",
    *,
    on_error: str = "raise",
) -> ParseStats:
    """TorchRec's ``BinaryCriteoUtils.tsv_to_npys``: one TSV file -> three npy files.

    Writes dense ``[N, 13]`` float32 (:func:`dense_log_transform`), sparse
    ``[N, 26]`` int64 (raw hex values; hash them when reading) and labels
    ``[N, 1]`` int32. For ``dataset_name="criteo_kaggle"`` a file named
    ``*test*`` has no labels and gets -1, as in TorchRec.
    """
    if dataset_name not in ("criteo_1tb", "criteo_kaggle"):
        raise ValueError(
            f"dataset_name must be 'criteo_1tb' or 'criteo_kaggle', got {dataset_name!r}"
        )
    # TorchRec tests the whole path for "test"; the file name is what is meant
    has_label = not (dataset_name == "criteo_kaggle" and "test" in Path(in_file).name)
    stats = ParseStats()
    labels, dense, sparse = read_criteo_tsv(
        in_file, has_label=has_label, on_error=on_error, stats=stats
    )
    for name, arr in [
        (out_dense_file, dense_log_transform(dense)),
        (out_sparse_file, sparse),
        (out_labels_file, labels.reshape(-1, 1)),
    ]:
        with open(name, "wb") as f:
            np.save(f, arr)
    return stats


def preprocess_criteo(
    input_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    dataset_name: str = "criteo_1tb",
    *,
    on_error: str = "raise",
) -> list[Path]:
    """TorchRec's ``scripts/npy_preproc_criteo.py``: every TSV in ``input_dir`` -> npy files.

    ``criteo_1tb`` reads ``day_0`` .. ``day_23`` and writes ``day_{i}_dense.npy``,
    ``day_{i}_sparse.npy``, ``day_{i}_labels.npy``; ``criteo_kaggle`` reads
    ``train.txt`` / ``test.txt`` and writes ``train_*.npy`` / ``test_*.npy``.
    Missing inputs are skipped (as TorchRec). Returns the dense files written.
    """
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if dataset_name == "criteo_1tb":
        pairs = [(f"day_{i}", f"day_{i}") for i in range(DAYS)]
    else:
        pairs = [("train.txt", "train"), ("test.txt", "test")]
    written = []
    for src, dst in pairs:
        if not (input_dir / src).exists():
            continue
        out = [output_dir / f"{dst}_{part}.npy" for part in ("dense", "sparse", "labels")]
        stats = tsv_to_npys(
            input_dir / src, out[0], out[1], out[2], dataset_name, on_error=on_error
        )
        print(f"{input_dir / src}: {stats.lines} lines, {stats.skipped} skipped -> {out[0].parent}")
        written.append(out[0])
    if not written:
        raise FileNotFoundError(
            f"no Criteo TSV files in {input_dir} (expected {pairs[0][0]}, ... for {dataset_name})"
        )
    return written
