"""Dense leaves (parameters, other variables, dense optax state) on disk, shard by shard.

One array per leaf, chunked along its shards so that processes write disjoint
chunks (replica 0 of each shard) and a restore reads each device's slice of the
target sharding, whatever the saved one was.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from . import store
from .paths import dense_leaves
from .stream import writes_shard


def leaf_path(root: str, part: str, i: int) -> str:
    return os.path.join(root, "dense", part, str(i))


def _chunks(array: jax.Array) -> list[int]:
    """The leaf's shard shape, its first dimension cut to at most ``CHUNK_BYTES`` (a
    divisor, so chunks never straddle shards)."""
    shard = list(array.sharding.shard_shape(array.shape))
    if not shard:
        return []
    row = int(np.prod(shard[1:], dtype=np.int64)) * np.dtype(array.dtype).itemsize
    rows = shard[0]
    best = 1
    for d in range(1, int(rows**0.5) + 1):
        if rows % d == 0:
            for c in (d, rows // d):
                if c * row <= store.CHUNK_BYTES:
                    best = max(best, c)
    return [best, *shard[1:]]


def index_entries(tree) -> list[dict]:
    """What the checkpoint's index records of each dense leaf of ``tree``."""
    return [
        {
            "path": list(c),
            "shape": list(x.shape),
            "dtype": np.dtype(x.dtype).name,
            "chunks": _chunks(x),
        }
        for c, x in dense_leaves(tree)
    ]


def create(root: str, part: str, entries: list[dict]) -> None:
    """Creates the leaves' arrays (metadata only; the primary process does this once)."""
    store.create(
        [
            (leaf_path(root, part, i), e["shape"], e["dtype"], e["chunks"])
            for i, e in enumerate(entries)
        ]
    )


def snapshot(tree, copy: bool) -> list[list[tuple[tuple, np.ndarray | jax.Array]]]:
    """Per leaf, the ``(index, data)`` shards this process writes (host copies if ``copy``)."""
    out = []
    for _, x in dense_leaves(tree):
        shards = [s for s in x.addressable_shards if writes_shard(x, s)]
        out.append([(tuple(s.index), np.array(s.data) if copy else s.data) for s in shards])
    return out


def save(root: str, part: str, entries: list[dict], shards) -> None:
    items = [
        (leaf_path(root, part, i), e["shape"], e["dtype"], e["chunks"])
        for i, e in enumerate(entries)
    ]
    arrays = store.open_arrays(items, part, write=True)
    futures = []
    for arr, leaf in zip(arrays, shards, strict=True):
        futures.extend(store.write(arr, index, np.asarray(data)) for index, data in leaf)
    for f in futures:
        f.result()


def restore(root: str, part: str, entries: list[dict], target, what: str) -> dict:
    """``{path components: jax.Array}`` of every dense leaf of ``target`` in its sharding."""
    saved = {tuple(e["path"]): (i, e) for i, e in enumerate(entries)}
    leaves = dense_leaves(target)
    items = []
    for comps, _ in leaves:
        i, e = saved[comps]
        items.append((leaf_path(root, part, i), e["shape"], e["dtype"], e["chunks"]))
    arrays = store.open_arrays(items, f"{what}: {part}")
    out = {}
    for (comps, like), arr in zip(leaves, arrays, strict=True):
        name = f"{what}: {part} leaf {'/'.join(comps)}"
        devices = like.sharding.addressable_devices_indices_map(like.shape)
        reads = {d: arr[index].read() for d, index in devices.items()}
        shards = []
        for d, future in reads.items():
            try:
                shards.append(jax.device_put(future.result(), d))
            except Exception as err:  # noqa: BLE001  (TensorStore raises ValueError)
                raise store.CheckpointCorruptError(f"{name}: {store.short(err)}") from None
        out[comps] = jax.make_array_from_single_device_arrays(like.shape, like.sharding, shards)
    return out
