"""Arrays on disk: zarr v3 through TensorStore, every chunk with a CRC32C checksum.

TensorStore (orbax's storage layer) verifies a chunk's checksum whenever it
reads it and names the file it read; missing chunks are errors, not zeros
(``fill_missing_data_reads=False``; every chunk is stored, zeros included).
Orbax itself is not used for arrays: its zarr chunks carry no checksum and it
writes ``jax.Array`` s, where a table under a sharding plan is a set of row and
column pieces of padded buffers.
"""

from __future__ import annotations

import os

import numpy as np
import tensorstore as ts

CHUNK_BYTES = 4 << 20  # the unit of checksums and of partial reads


class CheckpointCorruptError(ValueError):
    """A checkpoint's file is damaged or missing; the message names the step, array and file."""


_CONTEXT = ts.Context({"file_io_concurrency": {"limit": 16}})


def _spec(path: str, shape, dtype, chunks) -> dict:
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": os.fspath(path)},
        "metadata": {
            "shape": list(shape),
            "data_type": np.dtype(dtype).name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
        },
    }


def row_chunks(shape, dtype) -> list[int]:
    """A chunk shape of whole rows (all dims but the first) of at most ``CHUNK_BYTES``."""
    shape = list(shape)
    if not shape:
        return []
    row = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize
    return [max(1, min(shape[0], CHUNK_BYTES // max(row, 1)))] + shape[1:]


def create(path: str, shape, dtype, chunks=None) -> ts.TensorStore:
    """A new array (an existing one at ``path`` is replaced)."""
    chunks = row_chunks(shape, dtype) if chunks is None else [max(1, c) for c in chunks]
    spec = _spec(path, shape, dtype, chunks)
    spec.update(create=True, delete_existing=True, store_data_equal_to_fill_value=True)
    return ts.open(spec, context=_CONTEXT).result()


def open_array(path: str, shape, dtype, what: str, chunks=None, *, write=False) -> ts.TensorStore:
    """The array at ``path``, checked against the shape, dtype and chunks the index expects."""
    chunks = row_chunks(shape, dtype) if chunks is None else [max(1, c) for c in chunks]
    spec = _spec(path, shape, dtype, chunks)
    spec.update(open=True, fill_missing_data_reads=False, store_data_equal_to_fill_value=True)
    try:
        return ts.open(spec, context=_CONTEXT, read=True, write=write).result()
    except Exception as e:  # noqa: BLE001  (TensorStore raises ValueError for every failure)
        raise CheckpointCorruptError(f"{what}: cannot open {path}: {short(e)}") from None


def read(array: ts.TensorStore, index, what: str) -> np.ndarray:
    try:
        return array[index].read().result()
    except Exception as e:  # noqa: BLE001
        raise CheckpointCorruptError(f"{what}: {short(e)}") from None


def write(array: ts.TensorStore, index, value: np.ndarray):
    """Starts writing ``value``; returns the future (``.result()`` waits for the disk)."""
    return array[index].write(value)


def short(error: Exception) -> str:
    """TensorStore's message without the spec it appends (the file is named before it)."""
    return str(error).split(" [tensorstore_spec=")[0]
