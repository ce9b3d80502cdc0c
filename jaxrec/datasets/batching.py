"""Host-side batches: the ``Batch`` type and an in-memory table -> ``Batch`` iterator.

TorchRec: ``torchrec.datasets.utils.Batch``. Every jaxrec dataset is a
:class:`TableDataset`: columns held in memory (or memory-mapped npy files),
cut into batches with **static** per-key capacities so a train step compiles
once. Batches stay numpy; the consumer does ``jax.device_put`` or
``jaxrec.distributed.shard_batch``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import jax
import numpy as np
import numpy.typing as npt

from ..metrics import roc_auc
from ..sparse import KeyedJaggedTensor


class Batch(NamedTuple):
    """One minibatch (TorchRec's ``torchrec.datasets.utils.Batch``); a pytree.

    Attributes:
        dense_features: ``[B, num_dense]`` float32 (``[B, 0]`` when there are none).
        sparse_features: ``KeyedJaggedTensor`` with numpy leaves and static capacities.
        labels: ``[B]`` float32.
    """

    dense_features: np.ndarray | jax.Array  # numpy until moved to the device
    sparse_features: KeyedJaggedTensor
    labels: np.ndarray | jax.Array


@dataclasses.dataclass(frozen=True)
class Ragged:
    """A variable-length sparse column: row ``i`` holds ``values[offsets[i]:offsets[i+1]]``."""

    values: np.ndarray  # [total] int
    offsets: np.ndarray  # [N + 1] int64, starts at 0

    def __post_init__(self):
        off = np.asarray(self.offsets)
        if off.ndim != 1 or off.size == 0 or off[0] != 0 or np.any(np.diff(off) < 0):
            raise ValueError("Ragged offsets must be 1-D, start at 0 and never decrease")
        if off[-1] != len(self.values):
            raise ValueError(f"Ragged offsets end at {off[-1]} but there are {len(self.values)=}")

    @staticmethod
    def from_lengths(values: npt.ArrayLike, lengths: npt.ArrayLike) -> Ragged:
        lengths = np.asarray(lengths, np.int64)
        return Ragged(np.asarray(values), np.concatenate([[0], np.cumsum(lengths)]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def max_length(self) -> int:
        return int(np.diff(self.offsets).max(initial=0))

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(values, lengths)`` of ``rows`` in that order."""
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        lengths = ends - starts
        total = int(lengths.sum())
        # position j of the output reads values[start of its row + j - first output slot of its row]
        first = np.cumsum(lengths) - lengths
        src = np.arange(total) + np.repeat(starts - first, lengths)
        return self.values[src], lengths


# np.ndarray [N] (one id per row), np.ndarray [N, L] (fixed L ids) or Ragged; Any because
# readers take every table's column i to be of one kind (checked on the first only)
Column: TypeAlias = Any


@dataclasses.dataclass(frozen=True)
class Table:
    """The columns of one file (or one in-memory block).

    Attributes:
        dense: ``[N, num_dense]`` float (may be a memory map).
        sparse: one column per key: ``[N]`` ids, ``[N, L]`` ids, or :class:`Ragged`.
        labels: ``[N]`` or ``[N, 1]`` numbers (float32 in batches).
    """

    dense: np.ndarray
    sparse: Sequence[Column]
    labels: np.ndarray

    def __len__(self) -> int:
        return int(np.shape(self.labels)[0])


class TableDataset:
    """Columns in memory -> :class:`Batch` iterator with static capacities.

    Per-key capacity of a batch of ``B`` rows: ``B * max_ids`` where ``max_ids``
    is 1 for ``[N]`` columns, ``L`` for ``[N, L]`` columns and the longest row
    (or the ``max_ids_per_sample`` given) for :class:`Ragged` columns. A batch
    whose ids exceed its capacity raises, or with ``overflow="truncate"`` keeps
    the first ids that fit and adds the dropped count to ``truncated_ids[key]``.

    Parts (several processes, or a process's devices): ``part=Part(p, n)`` takes
    the global batches ``s * n + p`` of one global order of rows (the tables'
    rows one after another, shuffled by ``(seed, epoch)``), so the parts of
    ``n`` interleaved are the one-part stream (``Part(0, 1)``), whatever ``n``.
    :meth:`batch_rows` gives those rows. With ``drop_last=False`` the rows after
    the last full round are split over the parts (``np.array_split``).
    ``part=None`` is the part the dataset was opened for (``self.part``; the
    loaders' ``part=`` argument), else the whole stream, which several JAX
    processes must ask for explicitly (``Part(0, 1)``): ``None`` then raises
    rather than giving each process an unrelated stream.

    Args:
        tables: one :class:`Table` or one per file.
        keys: sparse feature names, in order.
        num_embeddings_per_feature: table size per key.
        max_ids_per_sample: optional ``{key: max ids per row}`` for ragged columns.
        hash_ids: apply ``id % num_embeddings`` per batch (Criteo's hashing);
            otherwise ids must already be in range (checked per batch).
        oracle_logits: ``[N]`` true logits when the data is synthetic.
    """

    def __init__(
        self,
        tables: Table | Sequence[Table],
        *,
        keys: Sequence[str],
        num_embeddings_per_feature: Sequence[int],
        max_ids_per_sample: Mapping[str, int] | None = None,
        hash_ids: bool = False,
        oracle_logits: np.ndarray | None = None,
    ):
        self.tables = [tables] if isinstance(tables, Table) else list(tables)
        self.keys = list(keys)
        self.num_embeddings_per_feature = [int(n) for n in num_embeddings_per_feature]
        if len(self.num_embeddings_per_feature) != len(self.keys):
            raise ValueError(
                f"num_embeddings_per_feature has {len(self.num_embeddings_per_feature)} "
                f"entries for {len(self.keys)} keys"
            )
        if not self.tables:
            raise ValueError("TableDataset needs at least one table")
        self.num_dense = int(np.shape(self.tables[0].dense)[1])
        for i, t in enumerate(self.tables):
            if len(t.sparse) != len(self.keys) or np.shape(t.dense)[1] != self.num_dense:
                raise ValueError(
                    f"table {i}: {len(t.sparse)} sparse columns and {np.shape(t.dense)[1]} dense "
                    f"columns; expected {len(self.keys)} and {self.num_dense}"
                )
        self.hash_ids = hash_ids
        self.part: Part | None = None  # the part a loader opened (rows read on demand)
        self.oracle_logits = oracle_logits
        self.truncated_ids = dict.fromkeys(self.keys, 0)
        self._starts = np.cumsum([0] + [len(t) for t in self.tables])
        if self.num_rows == 0:
            raise ValueError(
                f"no rows: all {len(self.tables)} table(s) are empty; a dataset needs data to batch"
            )
        given = dict(max_ids_per_sample or {})
        unknown = set(given) - set(self.keys)
        if unknown:
            raise ValueError(f"max_ids_per_sample names unknown keys {sorted(unknown)}")
        self.max_ids_per_sample = [
            given.get(k) or self._max_ids(i) for i, k in enumerate(self.keys)
        ]

    # ----- sizes -----
    @property
    def num_rows(self) -> int:
        return int(self._starts[-1])

    def __len__(self) -> int:
        return self.num_rows

    def capacities(self, batch_size: int) -> tuple[int, ...]:
        """Static per-key capacities of a batch of ``batch_size`` rows."""
        return tuple(batch_size * m for m in self.max_ids_per_sample)

    def _max_ids(self, i: int) -> int:
        cols = [t.sparse[i] for t in self.tables]
        if isinstance(cols[0], Ragged):
            return max(max(c.max_length() for c in cols), 1)
        return 1 if np.ndim(cols[0]) == 1 else int(np.shape(cols[0])[1])

    def labels(self) -> np.ndarray:
        """All labels, ``[N]`` float32."""
        return np.concatenate([np.asarray(t.labels, np.float32).reshape(-1) for t in self.tables])

    def reference_metrics(self, other: TableDataset | None = None) -> dict[str, float]:
        """The planted model's ``{"oracle_auc": ...}`` on ``other`` (or self); ``{}`` if real."""
        data = self if other is None else other
        if data.oracle_logits is None:
            return {}
        return {"oracle_auc": roc_auc(data.labels(), data.oracle_logits)}

    # ----- iteration -----
    def num_batches(
        self, batch_size: int, *, part: Part | None = None, drop_last: bool = True
    ) -> int:
        """How many batches :meth:`batches` yields to ``part``."""
        full, rest = _plan(self.num_rows, batch_size, self._part(part))
        return full + (0 if drop_last else int(rest > 0))

    def batch_rows(
        self,
        batch_size: int,
        *,
        part: Part | None = None,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
        drop_last: bool = True,
    ) -> list[np.ndarray]:
        """The global rows (over the tables in order) of each batch ``part`` gets.

        A function of ``(seed, epoch, batch, part)`` only: part ``p`` of ``n``
        reads these rows and no others.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        p, n = part = self._part(part)
        if shuffle:
            order = np.random.default_rng([seed, epoch, 0]).permutation(self.num_rows)
        else:
            order = np.arange(self.num_rows)
        full, rest = _plan(self.num_rows, batch_size, part)
        out = [order[(s * n + p) * batch_size :][:batch_size] for s in range(full)]
        if not drop_last and rest:
            out.append(np.array_split(order[full * batch_size * n :], n)[p])
        return out

    def batches(
        self,
        batch_size: int,
        *,
        part: Part | None = None,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
        drop_last: bool = True,
        capacities: Sequence[int] | None = None,
        overflow: str = "raise",
    ) -> Iterator[Batch]:
        """``part``'s batches of one epoch, in an order set by ``(seed, epoch)``.

        Args:
            batch_size: rows per batch.
            part: which batches (see the class docstring); ``None``: ``self.part``,
                else the whole stream (required with several JAX processes).
            shuffle, seed, epoch: the order of rows (``np.random.default_rng``).
            drop_last: ``False`` also yields the smaller last batch (with smaller
                capacities: one more compile).
            capacities: overrides the static per-key capacities.
            overflow: ``"raise"`` or ``"truncate"``.
        """
        if overflow not in ("raise", "truncate"):
            raise ValueError(f"overflow must be 'raise' or 'truncate', got {overflow!r}")
        caps = list(self.capacities(batch_size) if capacities is None else capacities)
        if len(caps) != len(self.keys):
            raise ValueError(f"capacities has {len(caps)} entries for {len(self.keys)} keys")
        plan = self.batch_rows(
            batch_size, part=part, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last
        )
        for rows in plan:
            small = len(rows) < batch_size and capacities is None
            yield self._batch(rows, list(self.capacities(len(rows))) if small else caps, overflow)

    def _part(self, part: Part | None) -> Part:
        return resolve_part(self.part if part is None else part)

    def _batch(self, rows: np.ndarray, caps: list[int], overflow: str) -> Batch:
        b = len(rows)
        dense, labels, cols = self._take(rows)
        self._check_finite(rows, dense, labels)
        values, lengths = [], []
        for i, key in enumerate(self.keys):
            v, ln = cols[i]
            v = np.asarray(v).astype(np.int64, copy=False)
            if self.hash_ids:
                v = v % self.num_embeddings_per_feature[i]
            elif v.size and (v.min() < 0 or v.max() >= self.num_embeddings_per_feature[i]):
                raise ValueError(
                    f"feature {key!r}: ids must lie in [0, {self.num_embeddings_per_feature[i]}), "
                    f"got min {v.min()} max {v.max()}"
                )
            if len(v) > caps[i]:
                v, ln = self._overflow(key, v, ln, caps[i], overflow)
            values.append(v)
            lengths.append(ln)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            self.keys,
            np.concatenate(values) if values else np.zeros(0, np.int64),
            np.concatenate(lengths) if lengths else np.zeros(0, np.int64),
            stride=b,
            capacities=caps,
            on_host=True,
        )
        return Batch(dense, kjt, labels)

    def _check_finite(self, rows: np.ndarray, dense: np.ndarray, labels: np.ndarray) -> None:
        """NaN or inf would reach the loss silently; name where it is instead."""
        for what, arr in (("dense value", dense), ("label", labels)):
            bad = ~np.isfinite(np.asarray(arr).reshape(len(rows), -1))
            if bad.any():
                j = int(np.argmax(bad.any(axis=1)))
                t = int(np.searchsorted(self._starts, rows[j], side="right") - 1)
                value = np.asarray(arr).reshape(len(rows), -1)[j][bad[j]][0]
                raise ValueError(
                    f"table {t} row {rows[j] - self._starts[t]}: non-finite {what} {value}; "
                    "fix or drop that row"
                )

    def _overflow(self, key, v, ln, cap, overflow):
        if overflow == "raise":
            raise ValueError(
                f"feature {key!r}: a batch holds {len(v)} ids but its capacity is {cap}; pass "
                f"larger capacities (or max_ids_per_sample), or overflow='truncate'"
            )
        ends = np.minimum(np.cumsum(ln), cap)
        ln = np.diff(np.concatenate([[0], ends]))
        self.truncated_ids[key] += len(v) - cap
        return v[:cap], ln

    def _take(self, rows: np.ndarray):
        """``(dense [b, D] f32, labels [b] f32, [(values, lengths) per key])`` of ``rows``."""
        if len(self.tables) == 1:
            return _take_table(self.tables[0], rows)
        part = np.searchsorted(self._starts, rows, side="right") - 1
        b = len(rows)
        dense = np.empty((b, self.num_dense), np.float32)
        labels = np.empty(b, np.float32)
        sparse: list[np.ndarray | None] = [None] * len(self.keys)
        for t in np.unique(part):
            mask = part == t
            d, lab, cols = _take_table(self.tables[t], rows[mask] - self._starts[t])
            dense[mask], labels[mask] = d, lab
            for i, (v, _) in enumerate(cols):
                if isinstance(self.tables[t].sparse[i], Ragged):
                    raise ValueError("ragged columns need a single table; concatenate the files")
                width = self.max_ids_per_sample[i]
                col = sparse[i]
                if col is None:
                    col = sparse[i] = np.empty((b, width), v.dtype)
                col[mask] = v.reshape(-1, width)
        cols = [(s.reshape(-1), np.full(b, s.shape[1], np.int64)) for s in _filled(sparse)]
        return dense, labels, cols


def _take_table(t: Table, rows: np.ndarray):
    # sorted reads are much faster on memory-mapped files; undo the sort afterwards
    order = np.argsort(rows, kind="stable")
    inv = np.empty_like(order)
    inv[order] = np.arange(len(order))
    srt = rows[order]
    dense = np.asarray(t.dense[srt], np.float32)[inv].reshape(len(rows), -1)
    labels = np.asarray(t.labels[srt], np.float32).reshape(-1)[inv]
    cols = []
    for c in t.sparse:
        if isinstance(c, Ragged):
            cols.append(c.take(rows))
        else:
            v = np.asarray(c[srt])[inv]
            width = 1 if v.ndim == 1 else v.shape[1]
            cols.append((v.reshape(-1), np.full(len(rows), width, np.int64)))
    return dense, labels, cols


class Part(NamedTuple):
    """Part ``index`` of ``count`` of a batch stream: the global batches ``s * count + index``.

    A process of a multi-process job passes its own,
    ``Part(jax.process_index(), jax.process_count())`` (or, feeding several
    devices, one part per device of ``world``); ``Part(0, 1)`` is the whole stream.
    """

    index: int
    count: int


WHOLE = Part(0, 1)


def resolve_part(part: Part | tuple[int, int] | None) -> Part:
    """``part`` checked; ``None`` is the whole stream, refused with several JAX processes."""
    if part is None:
        jax = sys.modules.get("jax")  # no jax imported: no jax.distributed processes either
        count = jax.process_count() if jax is not None else 1
        if count > 1:
            raise ValueError(
                f"part: {count} JAX processes are running, so say which batches this one "
                "reads: part=Part(jax.process_index(), jax.process_count()) for its share, "
                "or part=Part(0, 1) for the whole stream (the same on every process)"
            )
        return WHOLE
    index, count = (int(x) for x in part)
    if not 0 <= index < count:
        raise ValueError(f"part: need 0 <= index < count, got {part}")
    return Part(index, count)


def _plan(num_rows: int, batch_size: int, part: Part) -> tuple[int, int]:
    """(full batches, rows of the last partial batch) of ``part``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    full = num_rows // (batch_size * part.count)
    rest = num_rows - full * batch_size * part.count
    return full, rest // part.count + int(part.index < rest % part.count)


def _filled(columns: list[np.ndarray | None]) -> list[np.ndarray]:
    """``columns``, each filled by some table (a batch's rows cover every key)."""
    if any(c is None for c in columns):
        raise ValueError("a batch of no rows has no sparse columns")  # rows=[]: nothing to take
    return [c for c in columns if c is not None]
