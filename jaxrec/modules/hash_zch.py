"""Dynamic embedding tables: rows keyed by the raw 64-bit id (TorchRec's
``HashZchManagedCollisionModule``, NVIDIA dynamicemb's tables).

A :class:`HashZchManagedCollisionModule` maps raw ids (int32, uint32, int64
under x64, or 64-bit ids as uint32 words, see :mod:`jaxrec.sparse.ids64`) to
the rows of a table of ``zch_size`` slots through a hash index on the device
(:mod:`jaxrec.modules.zch_index`): static shapes, ``W`` probes per id, no sort
of the table. In training it admits new ids (all, after ``threshold``
sightings, or with a probability), evicts by LRU, LFU or TTL when a bucket is
full, and reports the evicted rows so that the collection behind it resets
them and their optimizer state before the lookup (evict, reset, lookup, as
TorchRec). Ids without a slot (rejected, or unseen in eval) map to
``FILL = 2**31 - 1``, out of range of every table: the collection behind a
dynamic table runs with ``BoundsCheckMode.IGNORE``, so they read zeros and
train nothing, and the module counts them (:meth:`counters`).

It plugs in where an ``MCHManagedCollisionModule`` does
(``ManagedCollisionCollection``, ``ManagedCollisionEmbeddingBagCollection`` /
``...EmbeddingCollection``); ``DistributedModelParallel`` shards it by the id's
hash (:class:`~jaxrec.distributed.ShardedHashZchCollection`).

Example:
    >>> mc = HashZchManagedCollisionModule(64, ways=8)
    >>> ids = jnp.asarray(to_id_words(np.array([2**40 + 1, 7, 2**40 + 1], np.int64)))
    >>> rows = mc.forward_flat(ids)
    >>> bool(rows[0] == rows[2]), int(mc.counters()["admitted"])
    (True, 2)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..embedding.collection import PlanLocal
from ..sparse.ids64 import id_words
from . import zch_index as zi
from .mc_modules import MCState
from .zch_policies import Admission, HashZchEvictionConfig

COUNTER_NAMES = ("admitted", "evicted", "rejected")


class EvictedRows(PlanLocal):
    """The latest training call's evicted rows: an output sized by the call's ids (so by
    the batch and the world size), not state: checkpoints leave it out and a restored
    state keeps the target's (the next training call overwrites it)."""


LRU = HashZchEvictionConfig()  # the default policy


def _int(value: object, name: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class HashZchManagedCollisionModule(nnx.Module):
    """A dynamic table's index: raw 64-bit ids -> rows, with admission and eviction.

    Args:
        zch_size: slots (= the table's rows), a multiple of ``ways``.
        ways: slots per bucket (probes per lookup). 16 by default.
        eviction_config: LRU (default), LFU or single-TTL eviction.
        admission: ``None`` (admit every id), ``FrequencyAdmission(threshold=n)``
            or ``ProbabilityAdmission(probability=p)``.
        total_num_buckets: buckets of the whole table (the hash's modulus);
            default ``zch_size // ways``. A sharded table needs it divisible by
            its world size (TorchRec's ``total_num_buckets``).
        input_hash_seed: seed of the id hash.
        output_global_offset: the first row (row-wise shards).
        max_evictions: static length of :meth:`evict`; default (on
            :meth:`ensure_buffers`) the call's id capacity, which never drops an
            eviction (smaller values pack them at the front, ``min(capacity,
            zch_size)`` still never drops one).
        name: informational.
        deterministic: ``True`` = eval (lookup only), flax's convention.
        implementation: ``None`` (on CPU the C++ kernel when built, else XLA) or
            ``"xla"`` (the XLA program everywhere; ``jax.export`` sets it).
    """

    # One MCState per zi.ZchState field, set by name in __init__.
    id_lo: MCState
    id_hi: MCState
    last_seen: MCState
    counts: MCState
    sketch: MCState
    current_iter: MCState
    occupancy: MCState
    evicted: EvictedRows | None

    def __init__(
        self,
        zch_size: int,
        *,
        ways: int = 16,
        eviction_config: HashZchEvictionConfig = LRU,
        admission: Admission = None,
        total_num_buckets: int | None = None,
        input_hash_seed: int = 0,
        output_global_offset: int = 0,
        max_evictions: int | None = None,
        name: str | None = None,
        deterministic: bool = False,
        implementation: str | None = None,
        _bucket_offset: int = 0,
    ):
        _int(zch_size, "zch_size", 1)
        _int(ways, "ways", 1)
        if zch_size % ways:
            raise ValueError(f"zch_size={zch_size} must be a multiple of ways={ways}")
        if not isinstance(eviction_config, HashZchEvictionConfig):
            raise TypeError(
                f"eviction_config must be a HashZchEvictionConfig, got {eviction_config!r}"
            )
        buckets = total_num_buckets if total_num_buckets is not None else zch_size // ways
        _int(buckets, "total_num_buckets", zch_size // ways)
        _int(output_global_offset, "output_global_offset", 0)
        if output_global_offset + zch_size >= zi.FILL:
            raise ValueError("rows must stay below 2**31 - 1 (int32 rows)")
        if max_evictions is not None:
            _int(max_evictions, "max_evictions", 1)
        self.layout = zi.ZchLayout(
            slots=zch_size,
            ways=ways,
            total_buckets=buckets,
            bucket_offset=_bucket_offset,
            row_offset=output_global_offset,
            seed=input_hash_seed,
            eviction=eviction_config,
            admission=admission,
            implementation=implementation,
        )  # raises on a bad admission / bucket range
        self.zch_size = zch_size
        self.output_global_offset = output_global_offset
        self.name = name
        self.deterministic = deterministic
        self._max_evictions_arg = max_evictions
        for field, value in zi.empty_state(self.layout)._asdict().items():
            setattr(self, field, MCState(value))
        zero = jnp.zeros((), jnp.int32)
        self.last_counts = MCState(jnp.stack([zero] * len(COUNTER_NAMES)))
        self.evicted = nnx.data(None)
        if max_evictions is not None:
            self.evicted = EvictedRows(jnp.full((max_evictions,), zi.FILL, jnp.int32))

    # ----- sizes and buffers -----
    def output_size(self) -> int:
        return self.zch_size

    @property
    def max_evictions(self) -> int:
        return self._evicted_buffer().shape[0]

    def _evicted_buffer(self) -> EvictedRows:
        if self.evicted is None:
            raise ValueError(
                "this module has no eviction buffer yet: pass max_evictions=... or call "
                "ensure_buffers(input_capacity) (or the module once, eagerly) first"
            )
        return self.evicted

    def ensure_buffers(self, input_capacity: int) -> None:
        """Allocates :meth:`evict`'s buffer for calls of up to ``input_capacity`` ids."""
        if self.evicted is None:
            _int(input_capacity, "input_capacity", 0)
            e = max(input_capacity, 1)  # >= the call's ids: unpacked, nothing dropped
            self.evicted = EvictedRows(jnp.full((e,), zi.FILL, jnp.int32))

    def state(self) -> zi.ZchState:
        return zi.ZchState(*(getattr(self, f)[...] for f in zi.ZchState._fields))

    def set_state(self, state: zi.ZchState) -> None:
        for f, value in state._asdict().items():
            getattr(self, f)[...] = value

    # ----- forward -----
    def forward_flat(
        self, values: jax.Array, valid: jax.Array | None = None, *, deterministic=None
    ) -> jax.Array:
        """``[C]`` raw ids (or ``[C, 2]`` id words) -> ``[C]`` int32 rows (``FILL``: no slot).

        Training calls admit, evict (see :meth:`evict`) and stamp; eval calls only read.
        """
        values = jnp.asarray(values)
        lo, hi = id_words(values)
        if lo.ndim != 1:
            raise TypeError(
                f"ids must be 1-D (or [C, 2] id words), got {values.dtype=} {values.shape=}"
            )
        ok = jnp.ones(lo.shape, bool) if valid is None else jnp.asarray(valid, bool)
        if not self.is_training(deterministic):
            return zi.remap(self.layout, self.state(), lo, hi, ok)
        self.ensure_buffers(lo.shape[0])
        step = zi.train_step(
            self.layout, self.state(), lo, hi, ok, max_evictions=self.max_evictions
        )
        self.set_state(step.state)
        self._evicted_buffer()[...] = step.evicted
        self.last_counts[...] = jnp.stack(list(step.counts))
        return step.rows

    def evict(self) -> jax.Array:
        """``[max_evictions]`` int32 rows evicted by the latest training call (``FILL``-padded)."""
        return self._evicted_buffer()[...]  # raises without buffers

    def open_slots(self) -> jax.Array:
        """int32 scalar: slots not holding an id."""
        return jnp.int32(self.zch_size) - self.occupancy[...]

    def counters(self) -> dict[str, jax.Array]:
        """The latest training call's ``admitted`` / ``evicted`` / ``rejected`` (distinct
        ids) and the current ``occupancy`` (slots holding an id), int32 scalars."""
        c = self.last_counts[...]
        return {**dict(zip(COUNTER_NAMES, c, strict=True)), "occupancy": self.occupancy[...]}

    def rebuild_with_output_id_range(
        self, output_id_range: tuple[int, int], output_segments: object = None
    ) -> HashZchManagedCollisionModule:
        """A fresh module for rows ``[start, end)`` of this one: whole buckets, same hash."""
        del output_segments
        start, end = output_id_range
        lay, off = self.layout, self.output_global_offset
        if (start - off) % lay.ways or (end - start) % lay.ways or not off <= start < end:
            raise ValueError(
                f"rows [{start}, {end}) must be whole buckets of {lay.ways} ways inside this "
                f"module's rows [{off}, {off + self.zch_size})"
            )
        return type(self)(
            end - start,
            ways=lay.ways,
            eviction_config=lay.eviction,
            admission=lay.admission,
            total_num_buckets=lay.total_buckets,
            input_hash_seed=lay.seed,
            output_global_offset=start,
            max_evictions=self._max_evictions_arg,
            name=self.name,
            deterministic=self.deterministic,
            implementation=lay.implementation,
            _bucket_offset=lay.bucket_offset + (start - off) // lay.ways,
        )

    def is_training(self, deterministic: bool | None = None) -> bool:
        return not bool(self.deterministic if deterministic is None else deterministic)
