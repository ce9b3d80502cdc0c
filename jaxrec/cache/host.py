"""A table and its optimizer state rows in host memory: the tier below a device cache."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from ..configs import BaseEmbeddingConfig
from ..optim.base import SparseOptimizer, row_fields

INIT_CHUNK_ROWS = 1 << 20


class HostTable:
    """``fields["weight"]`` ``[num_embeddings, dim]`` and each optimizer row field
    (``[num_embeddings]`` or ``[num_embeddings, dim]``) as numpy arrays.

    Build with :meth:`create` (initialised on the host, a chunk of rows at a time) or
    :meth:`from_arrays` (e.g. a table trained or restored elsewhere).
    """

    def __init__(self, config: BaseEmbeddingConfig, fields: Mapping[str, np.ndarray]):
        self.config = config
        self.fields = dict(fields)
        rows = config.num_embeddings
        for name, a in self.fields.items():
            if a.shape[0] != rows or a.ndim not in (1, 2):
                raise ValueError(
                    f"host table {config.name!r} field {name!r}: shape {a.shape}, expected "
                    f"[{rows}] or [{rows}, {config.embedding_dim}]"
                )

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.fields.values())

    @staticmethod
    def create(config: BaseEmbeddingConfig, optimizer: SparseOptimizer, seed: int = 0) -> HostTable:
        """Weights drawn as the table's initialiser draws them (uniform in
        ``[-sqrt(1/num_embeddings), sqrt(1/num_embeddings)]`` unless ``init_fn``), a
        chunk of rows at a time (other values than a device-built table of the same
        seed); optimizer rows at their initial values."""
        rows, dim = config.num_embeddings, config.embedding_dim
        weight = np.empty((rows, dim), np.dtype(config.dtype))
        key = jax.random.key(seed)
        lo, hi = config.get_weight_init_min(), config.get_weight_init_max()
        for i, r0 in enumerate(range(0, rows, INIT_CHUNK_ROWS)):
            n = min(INIT_CHUNK_ROWS, rows - r0)
            k = jax.random.fold_in(key, i)
            if config.init_fn is not None:
                chunk = config.init_fn(k, (n, dim), config.dtype)
            else:
                chunk = jax.random.uniform(k, (n, dim), np.float32, lo, hi)
            weight[r0 : r0 + n] = np.asarray(chunk).astype(weight.dtype)
        return HostTable(config, {"weight": weight, **initial_state(optimizer, rows, dim)})

    @staticmethod
    def from_arrays(
        config: BaseEmbeddingConfig,
        optimizer: SparseOptimizer,
        weight: np.ndarray,
        state: Mapping[str, np.ndarray] | None = None,
    ) -> HostTable:
        """From given weights (copied) and optimizer rows (default: initial values)."""
        rows, dim = config.num_embeddings, config.embedding_dim
        fields = {"weight": np.array(weight, np.dtype(config.dtype))}
        init = initial_state(optimizer, rows, dim)
        for f, a in init.items():
            fields[f] = a if state is None else np.array(state[f], a.dtype).reshape(a.shape)
        return HostTable(config, fields)


def initial_state(optimizer: SparseOptimizer, rows: int, dim: int) -> dict[str, np.ndarray]:
    """The optimizer's row fields for ``rows`` rows, at their initial values (one row
    is built on the device and repeated on the host)."""
    one = optimizer.init(1, dim)
    out = {}
    for f in row_fields(one):
        row = np.asarray(getattr(one, f))
        out[f] = np.repeat(row, rows, axis=0)
    return out


def check_host(name, host: HostTable, device, optimizer, readers) -> None:
    """The host table fits the device's slot table, its optimizer and its features."""
    hc = host.config
    if (hc.embedding_dim, hc.dtype) != (device.embedding_dim, device.dtype):
        raise ValueError(
            f"host table {name!r} is [{hc.num_embeddings}, {hc.embedding_dim}] {hc.dtype}, its "
            f"device table has dim {device.embedding_dim} and dtype {device.dtype}"
        )
    if tuple(hc.feature_names) != tuple(device.feature_names):
        raise ValueError(
            f"host table {name!r} reads features {list(hc.feature_names)}, its device table "
            f"{list(device.feature_names)}"
        )
    want = {"weight", *initial_state(optimizer.for_table(name), 1, hc.embedding_dim)}
    if set(host.fields) != want:
        raise ValueError(
            f"host table {name!r} has fields {sorted(host.fields)}, its optimizer needs "
            f"{sorted(want)} (build it with HostTable.create / from_arrays and that optimizer)"
        )
    for f in tuple(hc.feature_names) or (name,):
        others = [t for t in readers.get(f, []) if t != name]
        if others:
            raise ValueError(
                f"feature {f!r} of cached table {name!r} is also read by {others}: the cache "
                "rewrites its ids as slots, so a cached table needs features of its own"
            )
