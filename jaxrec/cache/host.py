"""A table and its optimizer state rows in host memory: the tier below a device cache."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from ..configs import BaseEmbeddingConfig
from ..embedding.optimizer import CombinedOptimizer
from ..ops.init import TablePiece, uniform_rows
from ..optim.base import SparseOptimizer, row_fields

INIT_CHUNK_ROWS = 1 << 20


class HostTable:
    """``fields["weight"]`` ``[rows, dim]`` and each optimizer row field (``[rows]`` or
    ``[rows, dim]``) as numpy arrays, for logical rows ``rows = (lo, hi)`` of the table
    (default: all ``num_embeddings``; with several processes, each holds the rows of its
    own devices' shards: :func:`jaxrec.cache.host_rows`).

    Build with :meth:`create` (initialised on the host, a chunk of rows at a time) or
    :meth:`from_arrays` (e.g. a table trained or restored elsewhere).
    """

    def __init__(
        self,
        config: BaseEmbeddingConfig,
        fields: Mapping[str, np.ndarray],
        rows: tuple[int, int] | None = None,
    ):
        self.config = config
        self.fields = dict(fields)
        self.rows = _rows(config, rows)
        n = self.rows[1] - self.rows[0]
        for name, a in self.fields.items():
            if a.shape[0] != n or a.ndim not in (1, 2):
                raise ValueError(
                    f"host table {config.name!r} field {name!r}: shape {a.shape}, expected "
                    f"[{n}] or [{n}, {config.embedding_dim}] (rows {list(self.rows)})"
                )

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.fields.values())

    @staticmethod
    def create(
        config: BaseEmbeddingConfig,
        optimizer: SparseOptimizer,
        seed: int = 0,
        rows: tuple[int, int] | None = None,
        *,
        key: jax.Array | None = None,
        stream: int = 0,
    ) -> HostTable:
        """Weights drawn as a collection draws its tables (``jaxrec.ops.init``: stream
        ``stream`` of ``key``, default ``jax.random.key(seed)``), a chunk of rows at a
        time; optimizer rows at their initial values.

        With the key of the collection the table belongs to
        (``jaxrec.distributed.init_keys(make)``) and the table's index in it as
        ``stream``, the rows equal those of the same table built on the devices,
        eagerly or sharded, whatever ``rows`` holds. A table with an ``init_fn``
        gets ``init_fn(fold_in(key, chunk), ...)`` per chunk of rows instead.
        """
        lo, hi = _rows(config, rows)
        dim = config.embedding_dim
        weight = np.empty((hi - lo, dim), np.dtype(config.dtype))
        key = jax.random.key(seed) if key is None else key
        low, high = config.get_weight_init_min(), config.get_weight_init_max()
        for i in range(lo // INIT_CHUNK_ROWS, -(-hi // INIT_CHUNK_ROWS)):
            r0 = i * INIT_CHUNK_ROWS
            a, b = max(lo, r0), min(hi, r0 + INIT_CHUNK_ROWS)  # the chunk's rows held here
            if config.init_fn is not None:
                n = min(INIT_CHUNK_ROWS, config.num_embeddings - r0)
                chunk = config.init_fn(jax.random.fold_in(key, i), (n, dim), config.dtype)
                weight[a - lo : b - lo] = np.asarray(chunk)[a - r0 : b - r0]
                continue
            piece = TablePiece(0, b - a, stream, a, 0, dim, low, high)
            block = uniform_rows(key, [piece], b - a, dim, config.dtype)
            weight[a - lo : b - lo] = np.asarray(block)
        state = initial_state(optimizer, hi - lo, dim)
        return HostTable(config, {"weight": weight, **state}, (lo, hi))

    @staticmethod
    def from_arrays(
        config: BaseEmbeddingConfig,
        optimizer: SparseOptimizer,
        weight: np.ndarray,
        state: Mapping[str, np.ndarray] | None = None,
        rows: tuple[int, int] | None = None,
    ) -> HostTable:
        """From given weights (copied) and optimizer rows (default: initial values) of
        logical rows ``rows`` (default: all)."""
        lo, hi = _rows(config, rows)
        dim = config.embedding_dim
        fields = {"weight": np.array(weight, np.dtype(config.dtype))}
        init = initial_state(optimizer, hi - lo, dim)
        for f, a in init.items():
            fields[f] = a if state is None else np.array(state[f], a.dtype).reshape(a.shape)
        return HostTable(config, fields, (lo, hi))


def _rows(config: BaseEmbeddingConfig, rows: tuple[int, int] | None) -> tuple[int, int]:
    if rows is None:
        return 0, config.num_embeddings
    lo, hi = (int(r) for r in rows)
    if not 0 <= lo <= hi <= config.num_embeddings:
        raise ValueError(
            f"host table {config.name!r}: rows {[lo, hi]} are not a range of its "
            f"{config.num_embeddings} rows"
        )
    return lo, hi


def initial_state(optimizer: SparseOptimizer, rows: int, dim: int) -> dict[str, np.ndarray]:
    """The optimizer's row fields for ``rows`` rows, at their initial values (one row
    is built on the device and repeated on the host)."""
    one = optimizer.init(1, dim)
    out = {}
    for f in row_fields(one):
        row = np.asarray(getattr(one, f))
        out[f] = np.repeat(row, rows, axis=0)
    return out


def check_host(
    name: str,
    host: HostTable,
    device: BaseEmbeddingConfig,
    optimizer: CombinedOptimizer,
    readers: Mapping[str, list[str]],
) -> None:
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
