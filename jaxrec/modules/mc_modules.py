"""Managed collision ("zero-collision hashing"): raw ids -> table rows, with eviction.

TorchRec's ``MCHManagedCollisionModule`` rebuilt with static shapes. A module
owns ``zch_size`` slots (table rows ``[offset, offset + zch_size)``). Each raw
id admitted to the table has a slot of its own, so admitted ids never
collide; ids not (yet) admitted share the miss row ``offset + zch_size - 1``
(or, with ``mch_size``, a residual hashed range after the slots). In
training, every call records its ids; every ``eviction_interval`` calls the
recorded ids compete with the table's by the eviction policy's score
(:mod:`jaxrec.modules.mc_policies`), the losers' slots are reset and reused.

::

    raw ids --preprocess--> keys (uint32) --profile (training)--> history
                                    |             every interval: evict/admit
                                    '--remap--> rows (int32) = slot of the key, or the miss row

**Id representation.** JAX runs without x64, so keys are uint32: a raw id is
a non-negative int32 (``[0, 2**31)``) or uint32 (``[0, 2**32 - 1)``) value,
or the output of ``input_hash_func``; it must lie in ``[0, input_hash_size)``
with ``input_hash_size <= 2**32 - 1`` (``0xFFFFFFFF`` marks empty slots).
64-bit raw ids are hashed into that range first, on the host
(:func:`~jaxrec.modules.mc_hash.hash_ids_64`) or in-graph from their halves
(:func:`~jaxrec.modules.mc_hash.hash_id_pairs`); both give the same result.
Out-of-range ids (negative, or ``>= input_hash_size``) and padding are never
recorded and map to the miss row. Under ``with jax.enable_x64(True):`` the
module also takes int64 ids in ``[0, input_hash_size)``.

**State** (all :class:`MCState` variables, neither ``nnx.Param`` nor
``EmbeddingTable``, so the train step keeps them in ``TrainState.rest`` and
the dense optimizer never sees them): the slot table sorted by key
(``sorted_ids`` uint32 ``[Z]``, ``slots`` int32 ``[Z]`` rows, ``counts``,
``last_access``), the training call counter, the history of recorded ids
since the last eviction (``[H]``, ``H = history_capacity``; ids past it are
dropped until the next eviction, as in TorchRec) and the rows evicted by the
latest training call (``evicted``, ``[E]``, ``E = max_evictions``).

**Training vs eval** follows flax's convention: ``deterministic=False``
(the default, training) profiles and evicts; ``model.eval()`` sets
``deterministic=True`` (remap only, no state change); ``model.train()``
switches back; ``__call__(..., deterministic=...)`` overrides per call.

Example:
    >>> mc = MCHManagedCollisionModule(
    ...     zch_size=4, eviction_policy=LFU_EvictionPolicy(), eviction_interval=1)
    >>> jt = JaggedTensor(values=jnp.array([7, 7, 9]), lengths=jnp.array([2, 1]))
    >>> mc({"t": jt})["t"].values().tolist()  # 7 and 9 admitted by this training call
    [1, 1, 2]
    >>> mc({"t": jt}, deterministic=True)["t"].values().tolist()  # eval: remap only
    [1, 1, 2]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from flax import nnx

from ..sparse import JaggedTensor
from .mc_hash import MAX_INPUT_HASH_SIZE, hash_ids
from .mc_policies import SENTINEL, MCHEvictionPolicy, SlotTable, evict_and_admit

EVICTION_FILL = 2**31 - 1  # unused entries of the evicted rows (out of range for every table)

HashFunc = Callable[[jax.Array, int], jax.Array]


class MCState(nnx.Variable):
    """Managed-collision state. Deliberately neither ``nnx.Param`` nor ``EmbeddingTable``:
    the dense optimizer and the sparse update both skip it; the forward updates it."""


class _History(NamedTuple):
    """A module's history buffers: ids and training calls seen, the fill, the evictions."""

    ids: MCState  # [H] uint32 keys
    iters: MCState  # [H] int32
    length: MCState  # int32 scalar
    evicted: MCState  # [max_evictions] int32 rows


def _positive_int(value: object, name: str, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class MCHManagedCollisionModule(nnx.Module):
    """Zero-collision hash table with eviction (TorchRec's ``MCHManagedCollisionModule``).

    Args:
        zch_size: slots, i.e. table rows ``[output_global_offset, +zch_size)``;
            the last is the shared miss row, so ``zch_size - 1`` ids fit. >= 2.
        eviction_policy: :class:`LFU_EvictionPolicy`, :class:`LRU_EvictionPolicy`
            or :class:`DistanceLFU_EvictionPolicy` (optionally with a threshold filter).
        eviction_interval: evict/admit on training calls ``k * eviction_interval``.
        input_hash_size: keys live in ``[0, input_hash_size)``; at most ``2**32 - 1``.
        input_hash_func: ``f(ids, input_hash_size) -> ids`` applied in-graph first
            (e.g. :func:`~jaxrec.modules.mc_hash.hash_ids`).
        mch_size: residual range: missed ids go to rows
            ``offset + zch_size + mch_hash_func(key, mch_size)`` instead of the
            miss row (TorchRec's deprecated "legacy MCH"); ``output_size()`` grows by it.
        mch_hash_func: ``f(keys uint32, mch_size) -> [0, mch_size)``; default
            :func:`~jaxrec.modules.mc_hash.hash_ids`.
        name: optional name (informational).
        output_global_offset: first row of this module's range (row-wise sharding).
        history_capacity: ids remembered between evictions. ``None``: allocated
            by the first call (or :meth:`ensure_buffers`) as the call's id
            capacity times ``eviction_interval``, so nothing is ever dropped.
        max_evictions: static size of :meth:`evict`'s result; at most
            ``min(zch_size - 1, history_capacity)`` (the default). Smaller caps
            the ids admitted per eviction (the best-ranked new ids replace the
            worst-ranked table entries).
        deterministic: ``True`` = eval mode (no profiling); see the module docs.

    Example:
        >>> mc = MCHManagedCollisionModule(
        ...     zch_size=1000, eviction_policy=LRU_EvictionPolicy(), eviction_interval=10,
        ...     input_hash_size=2**32 - 1, history_capacity=4096)
        >>> mc.output_size(), mc.max_evictions
        (1000, 999)
    """

    def __init__(
        self,
        zch_size: int,
        *,
        eviction_policy: MCHEvictionPolicy,
        eviction_interval: int,
        input_hash_size: int = MAX_INPUT_HASH_SIZE,
        input_hash_func: HashFunc | None = None,
        mch_size: int | None = None,
        mch_hash_func: HashFunc | None = None,
        name: str | None = None,
        output_global_offset: int = 0,
        history_capacity: int | None = None,
        max_evictions: int | None = None,
        deterministic: bool = False,
    ):
        _positive_int(zch_size, "zch_size", 2)
        _positive_int(eviction_interval, "eviction_interval")
        if not isinstance(eviction_policy, MCHEvictionPolicy):
            raise TypeError(
                "eviction_policy must be an MCHEvictionPolicy such as LFU_EvictionPolicy(), "
                f"got {eviction_policy!r}"
            )
        if not (isinstance(input_hash_size, int) and 1 <= input_hash_size <= MAX_INPUT_HASH_SIZE):
            raise ValueError(
                f"input_hash_size must be an int in [1, 2**32 - 1], got {input_hash_size!r}; "
                "hash 64-bit ids into that range first (hash_ids_64 / input_hash_func=hash_ids)"
            )
        if mch_size is not None:
            _positive_int(mch_size, "mch_size")
        elif mch_hash_func is not None:
            raise ValueError("mch_hash_func needs mch_size (the residual range it hashes into)")
        _positive_int(output_global_offset, "output_global_offset", 0)
        end = output_global_offset + zch_size + (mch_size or 0)
        if end >= EVICTION_FILL:
            raise ValueError(
                f"rows [{output_global_offset}, {end}) must stay below 2**31 - 1 (int32 rows)"
            )
        if history_capacity is not None:
            _positive_int(history_capacity, "history_capacity")
        if max_evictions is not None:
            _positive_int(max_evictions, "max_evictions")
        for fn, what in ((input_hash_func, "input_hash_func"), (mch_hash_func, "mch_hash_func")):
            if fn is not None and not callable(fn):
                raise TypeError(f"{what} must be callable f(ids, size), got {fn!r}")

        self.zch_size = zch_size
        self.eviction_policy = eviction_policy
        self.eviction_interval = eviction_interval
        self.input_hash_size = input_hash_size
        self.input_hash_func = input_hash_func
        self.mch_size = mch_size
        self.mch_hash_func = mch_hash_func if mch_hash_func is not None else hash_ids
        self.name = name
        self.output_global_offset = output_global_offset
        self.history_capacity = history_capacity
        self._max_evictions_arg = max_evictions
        self.deterministic = deterministic

        z = zch_size
        self.sorted_ids = MCState(jnp.full((z,), SENTINEL, jnp.uint32))
        self.slots = MCState(
            jnp.arange(output_global_offset, output_global_offset + z, dtype=jnp.int32)
        )
        self.counts = MCState(jnp.zeros((z,), jnp.int32))
        self.last_access = MCState(jnp.zeros((z,), jnp.int32))
        self.current_iter = MCState(jnp.zeros((), jnp.int32))
        self.last_eviction_iter = MCState(jnp.zeros((), jnp.int32))
        self.history_ids = nnx.data(None)
        self.history_iters = nnx.data(None)
        self.history_len = nnx.data(None)
        self.evicted = nnx.data(None)
        if history_capacity is not None:
            self._allocate(history_capacity)

    # ----- sizes -----
    def input_size(self) -> int:
        return self.input_hash_size

    def output_size(self) -> int:
        """Rows this module maps into: ``zch_size + mch_size``."""
        return self.zch_size + (self.mch_size or 0)

    @property
    def max_evictions(self) -> int:
        """Static length of :meth:`evict`'s result (needs the history buffer)."""
        return self._history().evicted.shape[0]

    def _history(self) -> _History:
        """The history buffers (allocated together by ``_allocate``), or ValueError."""
        ids, iters, length = self.history_ids, self.history_iters, self.history_len
        evicted = self.evicted
        if ids is None or iters is None or length is None or evicted is None:
            raise ValueError(
                "this module has no history buffer yet: pass history_capacity=... or call "
                "ensure_buffers(input_capacity) (or the module once) first"
            )
        return _History(ids, iters, length, evicted)

    def ensure_buffers(self, input_capacity: int) -> None:
        """Allocates the history (``input_capacity * eviction_interval``) if not done yet.

        Call it eagerly before ``nnx.split`` / ``init_train_state`` when
        ``history_capacity`` is ``None``: a jitted train step cannot add variables.
        """
        if self.history_ids is None:
            _positive_int(input_capacity, "input_capacity", 0)
            self._allocate(max(input_capacity * self.eviction_interval, 1))

    def _allocate(self, h: int) -> None:
        pairs = min(self.zch_size - 1, h)
        e = pairs if self._max_evictions_arg is None else min(self._max_evictions_arg, pairs)
        self.history_ids = MCState(jnp.full((h,), SENTINEL, jnp.uint32))
        self.history_iters = MCState(jnp.zeros((h,), jnp.int32))
        self.history_len = MCState(jnp.zeros((), jnp.int32))
        self.evicted = MCState(jnp.full((e,), EVICTION_FILL, jnp.int32))

    # ----- flat (per table) stages -----
    def keys(self, values: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """``preprocess`` of a flat buffer: ``[C]`` raw ids -> ``[C]`` uint32 keys.

        Invalid entries (``valid`` False, negative, ``>= input_hash_size`` after
        ``input_hash_func``) become ``0xFFFFFFFF``.
        """
        values = jnp.asarray(values)
        if not jnp.issubdtype(values.dtype, jnp.integer) or values.ndim != 1:
            raise TypeError(
                f"managed-collision ids must be a 1-D integer array, got {values.dtype=} "
                f"{values.shape=}; pass int32/uint32 ids (hash 64-bit ids with hash_ids_64)"
            )
        if self.input_hash_func is not None:
            values = jnp.asarray(self.input_hash_func(values, self.input_hash_size))
            if not jnp.issubdtype(values.dtype, jnp.integer):
                raise TypeError(f"input_hash_func must return integer ids, got {values.dtype=}")
        ok = jnp.ones(values.shape, bool) if valid is None else valid
        if jnp.issubdtype(values.dtype, jnp.signedinteger):
            ok = ok & (values >= 0)
        if values.dtype.itemsize > 4:  # int64 under enable_x64: compare before narrowing
            ok = ok & (values < self.input_hash_size)
        keys = values.astype(jnp.uint32)
        ok = ok & (keys < jnp.uint32(self.input_hash_size))
        return jnp.where(ok, keys, jnp.uint32(SENTINEL))

    def validate_ids(self, values: npt.ArrayLike, valid: jax.Array | None = None) -> None:
        """Host check: raises ``ValueError`` if a real id falls outside ``[0, input_hash_size)``.

        On the device such ids silently remap to the miss row and are never
        admitted; call this on host batches (numpy) to catch them instead.
        """
        host = np.asarray(values)
        if host.dtype == object or not np.issubdtype(host.dtype, np.integer):
            raise TypeError(f"ids must be integers, got {host.dtype=}")
        keys = np.asarray(self.keys(jnp.asarray(values), None if valid is None else valid))
        real = np.ones(host.shape, bool) if valid is None else np.asarray(valid, bool)
        bad = real & (keys == SENTINEL)
        if bad.any():
            raise ValueError(
                f"{int(bad.sum())} ids lie outside [0, input_hash_size={self.input_hash_size}) "
                f"after input_hash_func (e.g. {host[bad][:3].tolist()}); hash them "
                "(input_hash_func=hash_ids, or hash_ids_64 on the host) or raise input_hash_size"
            )

    def profile_keys(self, keys: jax.Array, *, deterministic: bool | None = None) -> None:
        """``profile`` of a flat buffer of keys: records them; evicts every interval.

        Training calls only (``deterministic`` False); sets :meth:`evict`'s rows.
        """
        _check_keys(keys)
        if self._is_deterministic(deterministic):
            return
        self.ensure_buffers(keys.shape[0])
        history = self._history()
        h = history.ids.shape[0]
        cur = self.current_iter[...] + 1
        valid = keys != SENTINEL
        pos = history.length[...] + jnp.cumsum(valid) - 1
        at = jnp.where(valid & (pos < h), pos, h)
        hist_ids = history.ids[...].at[at].set(keys, mode="drop")
        hist_iters = history.iters[...].at[at].set(cur, mode="drop")
        hist_len = jnp.minimum(history.length[...] + jnp.sum(valid), h).astype(jnp.int32)
        table = SlotTable(
            self.sorted_ids[...], self.slots[...], self.counts[...], self.last_access[...]
        )
        e = history.evicted.shape[0]
        policy = self.eviction_policy

        def evict(table, hist_len):
            new, rows = evict_and_admit(
                policy, table, (hist_ids, hist_iters, hist_len), cur, e, EVICTION_FILL
            )
            return new, rows, jnp.zeros((), jnp.int32), cur

        def keep(table, hist_len):
            rows = jnp.full((e,), EVICTION_FILL, jnp.int32)
            return table, rows, hist_len, self.last_eviction_iter[...]

        due = cur - self.last_eviction_iter[...] == self.eviction_interval
        table, rows, hist_len, last_ev = jax.lax.cond(due, evict, keep, table, hist_len)
        self.sorted_ids[...], self.slots[...] = table.sorted_ids, table.slots
        self.counts[...], self.last_access[...] = table.counts, table.last_access
        history.ids[...], history.iters[...] = hist_ids, hist_iters
        history.length[...], self.last_eviction_iter[...] = hist_len, last_ev
        self.current_iter[...] = cur
        history.evicted[...] = rows

    def remap_keys(self, keys: jax.Array) -> jax.Array:
        """``remap`` of a flat buffer: ``[C]`` uint32 keys -> ``[C]`` int32 rows (pure read)."""
        _check_keys(keys)
        z, offset = self.zch_size, self.output_global_offset
        sorted_ids, slots = self.sorted_ids[...], self.slots[...]
        pos = jnp.searchsorted(sorted_ids[:-1], keys)
        valid = keys != SENTINEL
        hit = valid & (sorted_ids[pos] == keys)
        # the miss slot never moves from the last entry: its row comes from the state, so
        # a row-wise shard's state works in a module built for any offset
        miss = jnp.broadcast_to(slots[z - 1], keys.shape)
        if self.mch_size:
            residual = jnp.asarray(self.mch_hash_func(keys, self.mch_size))
            residual = (residual.astype(jnp.uint32) % jnp.uint32(self.mch_size)).astype(jnp.int32)
            miss = jnp.where(valid, offset + z + residual, miss)
        return jnp.where(hit, slots[pos], miss)

    def forward_flat(
        self, values: jax.Array, valid: jax.Array | None = None, *, deterministic=None
    ) -> jax.Array:
        """preprocess -> profile (training) -> remap on a flat ``[C]`` id buffer.

        Args:
            values: ``[C]`` int32/uint32 raw ids.
            valid: ``[C]`` bool, False for padding (never recorded).
            deterministic: overrides the module's mode for this call.

        Returns:
            ``[C]`` int32 rows in ``[offset, offset + output_size())``.
        """
        keys = self.keys(values, valid)
        self.profile_keys(keys, deterministic=deterministic)
        return self.remap_keys(keys)

    # ----- TorchRec's dict-of-JaggedTensor stages -----
    def preprocess(self, features: Mapping[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        """Raw ids -> uint32 keys (``input_hash_func``; invalid and padding -> 0xFFFFFFFF)."""
        return {
            k: _with_values(jt, self.keys(jt.values(), jt.valid_mask()))
            for k, jt in _check_features(features).items()
        }

    def profile(
        self, features: Mapping[str, JaggedTensor], *, deterministic: bool | None = None
    ) -> dict[str, JaggedTensor]:
        """Records preprocessed features (training only) and evicts every interval."""
        features = _check_features(features)
        keys = [jt.values() for jt in features.values()]
        if keys and not self._is_deterministic(deterministic):
            self.profile_keys(jnp.concatenate(keys), deterministic=deterministic)
        return dict(features)

    def remap(self, features: Mapping[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        """Preprocessed features -> int32 rows (same lengths, weights, capacity)."""
        return {
            k: _with_values(jt, self.remap_keys(jt.values()))
            for k, jt in _check_features(features).items()
        }

    def __call__(
        self, features: Mapping[str, JaggedTensor], *, deterministic: bool | None = None
    ) -> dict[str, JaggedTensor]:
        """TorchRec's forward: ``remap(profile(preprocess(features)))``."""
        features = self.preprocess(features)
        features = self.profile(features, deterministic=deterministic)
        return self.remap(features)

    def evict(self) -> jax.Array:
        """``[max_evictions]`` int32 rows evicted by the latest training call (to reset).

        Rows are global (slot + ``output_global_offset``); unused entries are
        ``EVICTION_FILL``. Every training call overwrites it; eval calls do not.
        Unlike TorchRec (which returns ``None`` or accumulates until read) it
        is a pure read with a static shape.
        """
        return self._history().evicted[...]  # raises without buffers

    def open_slots(self) -> jax.Array:
        """int32 scalar: slots not holding an id (the miss slot excluded)."""
        used = jnp.sum(self.sorted_ids[...] != SENTINEL).astype(jnp.int32)
        return jnp.int32(self.zch_size - 1) - used

    def rebuild_with_output_id_range(
        self, output_id_range: tuple[int, int], output_segments: object = None
    ) -> MCHManagedCollisionModule:
        """A fresh module (same configuration) for rows ``[start, end)`` (row-wise shards)."""
        del output_segments  # TorchRec's resharding metadata; unused
        start, end = output_id_range
        if self.mch_size:
            raise NotImplementedError("row-wise rebuilding of a module with mch_size")
        return type(self)(
            end - start,
            eviction_policy=self.eviction_policy,
            eviction_interval=self.eviction_interval,
            input_hash_size=self.input_hash_size,
            input_hash_func=self.input_hash_func,
            name=self.name,
            output_global_offset=start,
            history_capacity=self.history_capacity,
            max_evictions=self._max_evictions_arg,
            deterministic=self.deterministic,
        )

    def is_training(self, deterministic: bool | None = None) -> bool:
        """Whether a call with this ``deterministic=`` argument profiles and evicts."""
        return not self._is_deterministic(deterministic)

    def _is_deterministic(self, deterministic: bool | None) -> bool:
        return bool(self.deterministic if deterministic is None else deterministic)


def _check_keys(keys: jax.Array) -> None:
    if keys.dtype != jnp.uint32 or keys.ndim != 1:
        raise TypeError(
            f"profile/remap take preprocessed keys (1-D uint32), got {keys.dtype=} "
            f"{keys.shape=}; pass the output of preprocess(features) (or keys(values))"
        )


def _with_values(jt: JaggedTensor, values: jax.Array) -> JaggedTensor:
    return JaggedTensor.from_parts(values, jt.lengths(), jt.weights_or_none())


def _check_features(features: object) -> Mapping[str, JaggedTensor]:
    if not isinstance(features, Mapping):
        raise TypeError(
            f"features must be a dict of JaggedTensor (TorchRec's API), got "
            f"{type(features).__name__}; wrap one with {{'name': jt}}"
        )
    for k, jt in features.items():
        if not isinstance(jt, JaggedTensor):
            raise TypeError(f"features[{k!r}] must be a JaggedTensor, got {type(jt).__name__}")
    return features
