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
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [max(1, int(c)) for c in chunks]},
            },
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


def create(items) -> list[ts.TensorStore]:
    """New arrays, created concurrently: ``items`` are ``(path, shape, dtype, chunks)``
    at paths where nothing exists yet."""
    futures = []
    for item in items:
        spec = _spec(*item)
        spec.update(create=True, store_data_equal_to_fill_value=True)
        futures.append(ts.open(spec, context=_CONTEXT))
    return [f.result() for f in futures]


def open_arrays(items, what: str, *, write: bool = False) -> list[ts.TensorStore]:
    """The arrays at ``items``' paths (``(path, shape, dtype, chunks)``), opened
    concurrently and checked against the shape, dtype and chunks the index expects."""
    futures = []
    for item in items:
        spec = _spec(*item)
        spec.update(open=True, fill_missing_data_reads=False, store_data_equal_to_fill_value=True)
        futures.append(ts.open(spec, context=_CONTEXT, read=True, write=write))
    out = []
    for (path, *_), f in zip(items, futures, strict=True):
        try:
            out.append(f.result())
        except Exception as e:  # noqa: BLE001  (TensorStore raises ValueError for every failure)
            raise CheckpointCorruptError(f"{what}: cannot open {path}: {short(e)}") from None
    return out


def write(array: ts.TensorStore, index, value: np.ndarray):
    """Starts writing ``value``; returns the future (``.result()`` waits for the disk)."""
    return array[index].write(value)


def short(error: Exception) -> str:
    """TensorStore's message without the spec it appends (the file is named before it)."""
    return str(error).split(" [tensorstore_spec=")[0]
