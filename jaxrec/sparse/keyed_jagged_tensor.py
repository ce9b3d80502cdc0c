"""KeyedJaggedTensor: many ragged features in one buffer with static per-key capacities."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import validation as v
from .bags import checked_lengths
from .capacity import resolve_capacities
from .formatting import keyed_jagged_repr
from .ids64 import from_id_words, id_words, is_wide, narrow_ids
from .jagged_tensor import JaggedTensor, lengths_to_offsets, segment_ids_from_ends

Capacities = Mapping[str, int] | Sequence[int] | int | None


@jax.tree_util.register_pytree_node_class
class KeyedJaggedTensor:
    """``F`` ragged features (keys) over a batch of ``B`` samples.

    ::

        #          0       1        2   <-- batch (stride B = 3)
        # "f1"   [0,1]   None     [2]
        # "f2"   [3]     [4]      [5,6,7]
        #
        # lengths = [2, 0, 1, 1, 1, 3]           key-major, [F * B]
        # values  = [0, 1, 2, p, | 3, 4, 5, 6, 7, p, p, p]
        #            '- f1: capacity 4  '- f2: capacity 8   (p = padding)

    Key ``k`` owns the static slice ``values[cap_start[k] : cap_start[k] + cap[k]]``,
    its bags packed at the front of it. ``lengths()`` and ``offsets()`` are
    TorchRec's (``offsets`` index a packed buffer, as in TorchRec; use
    ``to_dict()`` or ``segment_ids()`` to address this buffer). Keys,
    capacities and the stride are static pytree metadata.

    Ids wider than 32 bits travel as **id words** (``jaxrec.sparse.ids64``):
    ``values`` is then ``uint32[sum(capacities), 2]`` (low word, high word)
    and every method works on it as on plain ids. Without x64, host int64 /
    uint64 ids that fit int32 become int32 and an array holding a wider id
    becomes id words, so the representation follows the batch's values (and
    a new one retraces a jitted step): pass ``to_id_words(ids)`` to fix it for
    a whole stream. Under x64 int64 ids stay int64. Lookups into plain tables
    call :meth:`narrow_ids` first: a wide id is out of range there.

    Args:
        keys: feature names, unique.
        values: ``[sum(capacities)]`` integer ids, or ``uint32[sum(capacities), 2]``
            id words (``to_id_words``).
        weights: optional ``[sum(capacities)]`` floating weights.
        lengths: ``[F * B]`` integer bag lengths, key-major. Or ``offsets``.
        offsets: ``[F * B + 1]`` TorchRec offsets.
        stride: batch size ``B``; defaults to ``len(lengths) // F``.
        capacities: per-key capacities (a sequence, a mapping or one int).
            ``None`` means TorchRec's packed layout (capacity = length of each
            key), which needs concrete lengths.
        validate: value checks on the host (lengths, capacities, finite
            weights); ``None`` checks host inputs only. Unchecked device inputs
            follow ``jaxrec.sparse.bags`` in lookups (invalid bags and
            non-finite weights contribute zero, reported by the bounds check).

    Example:
        >>> kjt = KeyedJaggedTensor(keys=["f1", "f2"], values=[0, 1, 2, 3, 4, 5, 6, 7],
        ...                         lengths=[2, 0, 1, 1, 1, 3])
        >>> kjt["f2"].to_dense()[2].tolist()
        [5, 6, 7]
    """

    __slots__ = ("_keys", "_caps", "_stride", "_values", "_lengths", "_weights")

    def __init__(
        self,
        keys: Sequence[str],
        values: Any,
        weights: Any = None,
        lengths: Any = None,
        offsets: Any = None,
        stride: int | None = None,
        *,
        capacities: Capacities = None,
        validate: bool | None = None,
    ):
        keys = _check_keys(keys)
        if lengths is None:
            if offsets is None:
                raise ValueError("KeyedJaggedTensor needs lengths or offsets; pass lengths=[...]")
            lengths = v.lengths_from_offsets(offsets)
        host = v.is_host(values) and v.is_host(lengths)
        host_weights = weights is not None and v.is_host(weights)
        values = v.as_ids_array(values, "values")
        lengths = v.as_int_array(lengths, "lengths")
        if not (values.ndim == 2 and is_wide(values)):
            v.check_rank(values, 1, "values")
        v.check_rank(lengths, 1, "lengths")
        if weights is not None:
            weights = v.as_float_array(weights, "weights")
            if weights.shape != values.shape[:1]:
                raise ValueError(
                    f"weights must match values' leading size: {weights.shape=} vs {values.shape=}"
                )
        stride = _resolve_stride(len(keys), lengths.shape[0], stride)
        if capacities is None:
            caps = _packed_capacities(keys, lengths, stride, values.shape[0])
        else:
            caps = resolve_capacities(keys, None, capacities)  # overflow: validate() below
            if sum(caps) != values.shape[0]:
                raise ValueError(
                    f"sum(capacities)={sum(caps)} must equal the values length {values.shape[0]}"
                )
        self._keys, self._caps, self._stride = keys, caps, stride
        self._values, self._lengths, self._weights = values, lengths, weights
        if validate:
            self.validate()
        elif validate is None:  # host inputs only: no device-to-host copy
            if host:
                self._check_layout()
            if host_weights:
                v.check_finite_weights(weights)

    # ----- pytree -----
    def tree_flatten(self):
        return (self._values, self._lengths, self._weights), (self._keys, self._caps, self._stride)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj._keys, obj._caps, obj._stride = aux
        obj._values, obj._lengths, obj._weights = children
        return obj

    @classmethod
    def from_parts(
        cls,
        keys: Sequence[str],
        values: jax.Array,
        lengths: jax.Array,
        weights: jax.Array | None = None,
        *,
        capacities: Sequence[int],
        stride: int,
    ) -> KeyedJaggedTensor:
        """Assembles a KJT from its leaves and its static layout, as ``tree_unflatten``
        does: the cheap constructor for code that already holds a valid layout
        (a lookup's remapped ids, a step's masked lengths).

        The arrays are taken as they are: no conversion, no shape or value check
        (they may carry leading dims, as inside ``shard_map`` or ``vmap``), so it
        adds nothing to a traced program and never copies to the host. Only the
        static layout is checked (at trace time). Use the constructor for user
        input, and :meth:`validate` to check values.

        Args:
            keys: feature names, unique.
            values: ``[sum(capacities)]`` ids (or ``[sum(capacities), 2]`` id
                words), key ``k`` in its capacity slot.
            lengths: ``[F * stride]`` bag lengths, key-major.
            weights: ``[sum(capacities)]`` or None.
            capacities: per-key capacities, in key order.
            stride: the batch size ``B``.

        Example:
            >>> kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], [1, 2, 3], [1, 0, 2, 0])
            >>> remapped = KeyedJaggedTensor.from_parts(
            ...     kjt.keys(), kjt.values() % 2, kjt.lengths(), kjt.weights_or_none(),
            ...     capacities=kjt.capacity_per_key(), stride=kjt.stride())
        """
        keys = _check_keys(keys)
        caps = tuple(int(c) for c in capacities)
        if len(caps) != len(keys):
            raise ValueError(
                f"from_parts needs one capacity per key: {len(keys)} keys, {len(caps)} capacities"
            )
        if any(c < 0 for c in caps):
            raise ValueError(f"capacities must be non-negative, got {caps}")
        if not isinstance(stride, int | np.integer) or stride < 0:
            raise ValueError(f"stride must be a non-negative int, got {stride!r}")
        return cls.tree_unflatten((keys, caps, int(stride)), (values, lengths, weights))

    # ----- static metadata -----
    def keys(self) -> list[str]:
        return list(self._keys)

    def stride(self) -> int:
        return self._stride

    def capacity_per_key(self) -> tuple[int, ...]:
        return self._caps

    def capacity_offsets(self) -> tuple[int, ...]:
        """``[F + 1]`` static start of each key's slice in ``values()``."""
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self._caps, dtype=np.int64)]))

    # ----- arrays -----
    def values(self) -> jax.Array:
        """``[sum(capacities)]`` ids, or ``uint32[sum(capacities), 2]`` id words."""
        return self._values

    def is_wide(self) -> bool:
        """Whether ``values()`` are id words (``uint32[..., 2]``) rather than plain ids.

        Decided by rank: words have one axis more than ``lengths`` (which also
        holds for KJTs stacked by ``shard_batch``, ``[world, C, 2]``).
        """
        return self._values.ndim == self._lengths.ndim + 1 and is_wide(self._values)

    def narrow_ids(self) -> KeyedJaggedTensor:
        """This KJT with id words narrowed to int32 row ids, for lookups into plain tables.

        An id is kept if it fits 31 bits (high word 0, low word below ``2**31``);
        every other id becomes ``-1``, which the bounds check reports as out of
        range (per ``BoundsCheckMode``) and drops, so a wide id never wraps onto
        a real row. Returns ``self`` when the values are plain ids (they are
        bounds-checked in their own dtype). Host (numpy) values stay on the host.

        Example:
            >>> kjt = KeyedJaggedTensor(["f"], np.array([3, 2**40], np.int64), lengths=[2])
            >>> kjt.is_wide(), kjt.narrow_ids().values().tolist()
            (True, [3, -1])
        """
        if not self.is_wide():
            return self
        return KeyedJaggedTensor.from_parts(
            self._keys, _narrow(self._values), self._lengths, self._weights,
            capacities=self._caps, stride=self._stride,
        )  # fmt: skip

    def lengths(self) -> jax.Array:
        return self._lengths

    def lengths_or_none(self) -> jax.Array:
        return self._lengths

    def offsets(self) -> jax.Array:
        """``[F * B + 1]`` TorchRec offsets ``[0, cumsum(lengths)]`` (packed layout)."""
        return lengths_to_offsets(self._lengths)

    def offsets_or_none(self) -> jax.Array:
        return self.offsets()

    def weights(self) -> jax.Array:
        if self._weights is None:
            raise ValueError("this KeyedJaggedTensor has no weights; build it with weights=...")
        return self._weights

    def weights_or_none(self) -> jax.Array | None:
        return self._weights

    def length_per_key(self) -> jax.Array:
        """``[F]`` number of values per key (an array: TorchRec returns a list)."""
        return self._lengths.reshape(len(self._keys), self._stride).sum(axis=1)

    def offset_per_key(self) -> jax.Array:
        """``[F + 1]`` packed start of each key, ``[0, cumsum(length_per_key)]``."""
        return lengths_to_offsets(self.length_per_key())

    def segment_ids(self) -> jax.Array:
        """``[C]`` global bag index ``k * B + b`` of every value; padding gets ``F * B``.

        This is how lookups address this buffer: one sorted segment id per
        value, across all keys. Values of invalid bags (a negative length, or
        past the key's capacity: see ``jaxrec.sparse.bags``) get ``F * B`` too,
        so a key that overflows never spills into the next key's bags.
        """
        f, b = len(self._keys), self._stride
        starts = np.asarray(self.capacity_offsets()[:-1], np.int32)
        key_of = np.repeat(np.arange(f, dtype=np.int32), self._caps)
        local = np.arange(sum(self._caps), dtype=np.int32) - starts[key_of]
        per_key = checked_lengths(self._lengths, self._caps, b).reshape(f, b)
        ends = jnp.cumsum(per_key, axis=1)  # [F, B] local bag ends
        global_ends = (ends + starts[:, None]).reshape(-1)
        seg = segment_ids_from_ends(global_ends, sum(self._caps))
        total = ends[:, -1] if b else jnp.zeros((f,), per_key.dtype)
        valid = local < total[key_of]
        return jnp.where(valid, seg, f * b)

    # ----- per-key views -----
    def to_dict(self) -> dict[str, JaggedTensor]:
        """``{key: JaggedTensor}`` by static slicing (no copies of the data layout)."""
        return {k: self[k] for k in self._keys}

    def __getitem__(self, key: str) -> JaggedTensor:
        i = self._key_index(key)
        lo, hi = self.capacity_offsets()[i], self.capacity_offsets()[i + 1]
        b = self._stride
        w = None if self._weights is None else self._weights[lo:hi]
        return JaggedTensor.from_parts(self._values[lo:hi], self._lengths[i * b : (i + 1) * b], w)

    def _key_index(self, key: str) -> int:
        try:
            return self._keys.index(key)
        except ValueError:
            raise KeyError(
                f"{key!r} is not a key of this KeyedJaggedTensor; keys are {list(self._keys)}"
            ) from None

    # ----- builders (host-side, TorchRec names) -----
    @staticmethod
    def from_jt_dict(jt_dict: Mapping[str, JaggedTensor]) -> KeyedJaggedTensor:
        """Concatenates per-key JaggedTensors; each keeps its own capacity."""
        keys = _check_keys(list(jt_dict))
        jts = list(jt_dict.values())
        if not jts:
            return KeyedJaggedTensor.empty()
        strides = {jt.num_bags() for jt in jts}
        if len(strides) != 1:
            sizes = {k: jt.num_bags() for k, jt in jt_dict.items()}
            raise ValueError(f"all features need the same batch size (stride); got {sizes}")
        weighted = [jt.weights_or_none() is not None for jt in jts]
        if any(weighted) and not all(weighted):
            raise ValueError("either every JaggedTensor has weights or none does")
        for k, jt in jt_dict.items():
            vals = jt.values()
            if not (vals.ndim == 1 or (vals.ndim == 2 and is_wide(vals))):
                raise ValueError(
                    f"feature {k!r} values must be 1-D ids or uint32[N, 2] id words, "
                    f"got {vals.dtype} {vals.shape}"
                )
            if not jnp.issubdtype(vals.dtype, jnp.integer):
                raise TypeError(
                    f"KeyedJaggedTensor values must be integer ids, got {k!r}: {vals.dtype=}"
                )
        values = _concat_values([jt.values() for jt in jts])
        lengths = jnp.concatenate([jt.lengths() for jt in jts])
        weights = jnp.concatenate([jt.weights() for jt in jts]) if all(weighted) else None
        caps = tuple(jt.capacity() for jt in jts)
        return KeyedJaggedTensor.from_parts(
            keys, values, lengths, weights, capacities=caps, stride=strides.pop()
        )

    @staticmethod
    def from_lengths_sync(
        keys: Sequence[str],
        values: Any,
        lengths: Any,
        weights: Any = None,
        stride: int | None = None,
        *,
        capacities: Capacities = None,
        on_host: bool = False,
    ) -> KeyedJaggedTensor:
        """From TorchRec's packed layout; each key gets a bucketed capacity unless given.

        ``on_host=True`` keeps the leaves as numpy arrays (int32 ids and lengths,
        float32 weights): data loaders build batches on the host and transfer
        them later (``jax.device_put``, ``shard_batch`` or a ``TrainPipeline``).
        ``values`` may be 1-D ids or ``uint32[N, 2]`` id words; without x64,
        int64 ids that do not fit int32 become id words (see the class doc).

        Example:
            >>> kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], [1, 2, 3], [1, 0, 2, 0])
            >>> kjt.capacity_per_key(), kjt.lengths().tolist()
            ((8, 8), [1, 0, 2, 0])
        """
        keys = _check_keys(keys)
        vals = v.untyped_empty_as_int(v.to_host(values), values)
        lens = v.untyped_empty_as_int(v.to_host(lengths), lengths)
        if not np.issubdtype(lens.dtype, np.integer) or not np.issubdtype(vals.dtype, np.integer):
            bad = "lengths" if not np.issubdtype(lens.dtype, np.integer) else "values"
            arr = lens if bad == "lengths" else vals
            raise TypeError(f"{bad} must have an integer dtype, got {arr.dtype=}")
        if not (vals.ndim == 1 or (vals.ndim == 2 and is_wide(vals))) or lens.ndim != 1:
            raise ValueError(
                f"values (or uint32[N, 2] id words) and lengths must be 1-D, got "
                f"{vals.dtype} {vals.shape=}, {lens.shape=}"
            )
        vals = v.host_ids_array(vals, "values")  # int32, or id words if an id is wider
        stride = _resolve_stride(len(keys), lens.shape[0], stride)
        v.check_lengths_values(lens, vals.shape[0])
        if int(lens.sum()) != vals.shape[0]:  # trailing values would be dropped silently
            raise ValueError(
                f"sum(lengths)={int(lens.sum())} must equal the number of values "
                f"{vals.shape[0]} (TorchRec's packed layout); pass only the ids of the bags"
            )
        lpk = lens.reshape(len(keys), stride).sum(axis=1) if keys else np.zeros(0, np.int64)
        caps = resolve_capacities(keys, lpk.tolist(), capacities)
        w = None if weights is None else np.asarray(v.as_float_array(v.to_host(weights), "weights"))
        if w is not None and w.shape != vals.shape[:1]:
            raise ValueError(f"weights must match values: {w.shape=} vs {vals.shape=}")
        if w is not None:
            v.check_finite_weights(w)
        out_v, out_w = _repack(vals, w, lpk, caps)
        if on_host:  # validated above; ids already in their device representation
            return KeyedJaggedTensor.from_parts(
                keys, out_v, lens.astype(np.int32), out_w, capacities=caps, stride=stride
            )
        return KeyedJaggedTensor(
            keys, out_v, out_w, lengths=lens, stride=stride, capacities=caps, validate=False
        )

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str],
        values: Any,
        offsets: Any,
        weights: Any = None,
        stride: int | None = None,
        *,
        capacities: Capacities = None,
    ) -> KeyedJaggedTensor:
        """Like ``from_lengths_sync`` but from TorchRec offsets ``[F * B + 1]``."""
        lengths = v.lengths_from_offsets(v.to_host(offsets))
        return KeyedJaggedTensor.from_lengths_sync(
            keys, values, lengths, weights, stride, capacities=capacities
        )

    @staticmethod
    def empty(
        is_weighted: bool = False, stride: int = 0, values_dtype: Any = jnp.int32
    ) -> KeyedJaggedTensor:
        weights = jnp.zeros((0,), jnp.float32) if is_weighted else None
        return KeyedJaggedTensor.from_parts(
            (),
            jnp.zeros((0,), values_dtype),
            jnp.zeros((0,), jnp.int32),
            weights,
            capacities=(),
            stride=stride,
        )

    @staticmethod
    def empty_like(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """No keys, same stride and dtypes (TorchRec's ``empty_like``)."""
        w = kjt.weights_or_none()
        return KeyedJaggedTensor.from_parts(
            (),
            jnp.zeros((0, 2) if kjt.is_wide() else (0,), kjt.values().dtype),
            jnp.zeros((0,), kjt.lengths().dtype),
            None if w is None else jnp.zeros((0,), w.dtype),
            capacities=(),
            stride=kjt.stride(),
        )

    # ----- reshaping (all static slicing and concatenation) -----
    def permute(self, indices: Sequence[int]) -> KeyedJaggedTensor:
        """Reorders (or drops) keys: result key ``i`` is ``keys()[indices[i]]``.

        Unlike TorchRec, an index may not repeat (keys stay unique, so
        ``to_dict()`` is well defined); rename with ``from_jt_dict`` instead.
        """
        f = len(self._keys)
        if len(set(indices)) != len(indices):
            raise ValueError(f"permute indices {list(indices)} repeats keys; keys must stay unique")
        for i in indices:
            if not 0 <= i < f:
                raise ValueError(f"permute index {i} is out of range for {f} keys")
        parts = [self[self._keys[i]] for i in indices]
        return _concat_parts(
            [self._keys[i] for i in indices], parts, self._stride, self._weights is not None, self
        )

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Splits keys into consecutive groups of the given sizes."""
        if sum(segments) != len(self._keys) or any(s < 0 for s in segments):
            raise ValueError(
                f"segments {list(segments)} must be non-negative and sum to {len(self._keys)} keys"
            )
        out, start = [], 0
        for n in segments:
            out.append(self.permute(range(start, start + n)))
            start += n
        return out

    @staticmethod
    def concat(kjt_list: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Concatenates the keys of several KJTs with the same stride."""
        if not kjt_list:
            raise ValueError("concat needs at least one KeyedJaggedTensor")
        strides = {k.stride() for k in kjt_list}
        if len(strides) != 1:
            raise ValueError(f"concat needs one stride, got strides {sorted(strides)}")
        weighted = {k.weights_or_none() is not None for k in kjt_list}
        if len(weighted) != 1:
            raise ValueError("concat needs every KeyedJaggedTensor weighted or none")
        keys = [key for k in kjt_list for key in k.keys()]
        _check_keys(keys)
        parts = [k[key] for k in kjt_list for key in k.keys()]
        return _concat_parts(keys, parts, strides.pop(), weighted.pop(), kjt_list[0])

    # ----- checks and printing -----
    def validate(self) -> None:
        """Host value check: non-negative lengths, every key within its capacity and
        finite weights (a device copy for arrays on device)."""
        self._check_layout()
        if self._weights is not None:
            v.check_finite_weights(self._weights)

    def _check_layout(self) -> None:
        lens = v.to_host(self._lengths)
        v.check_lengths_values(lens, sum(self._caps))
        if not self._keys:
            return
        lpk = lens.reshape(len(self._keys), self._stride).sum(axis=1)
        resolve_capacities(self._keys, lpk.tolist(), self._caps)

    def __repr__(self) -> str:
        if any(v.is_traced(x) for x in (self._values, self._lengths)):
            return (
                f"KeyedJaggedTensor(keys={list(self._keys)}, stride={self._stride}, "
                f"capacities={self._caps}, traced)"
            )
        items = []
        for k, jt in self.to_dict().items():
            w = jt.weights_or_none()
            ids = np.asarray(jt.values())
            items.append(
                (
                    k,
                    from_id_words(ids, signed=True) if self.is_wide() else ids,
                    np.asarray(jt.lengths()),
                    None if w is None else np.asarray(w),
                )
            )
        return keyed_jagged_repr(items)


def _check_keys(keys: Sequence[str]) -> tuple[str, ...]:
    if isinstance(keys, str):
        raise TypeError(
            f"keys must be a sequence of str, got the single string {keys!r}; wrap it in a list"
        )
    keys = tuple(keys)
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"keys must be str, got {k!r} of type {type(k).__name__}")
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"duplicate keys {dup}; every feature name must appear once")
    return keys


def _resolve_stride(num_keys: int, num_lengths: int, stride: int | None) -> int:
    if stride is None:
        if num_keys == 0:
            if num_lengths:
                raise ValueError(f"got {num_lengths} lengths but no keys")
            return 0
        stride = num_lengths // num_keys
    if num_lengths != num_keys * stride:
        raise ValueError(
            f"lengths has {num_lengths} entries but {num_keys} keys x stride {stride} = "
            f"{num_keys * stride}; lengths must be key-major [F * B]"
        )
    return stride


def _packed_capacities(keys, lengths, stride, num_values) -> tuple[int, ...]:
    """Capacities of TorchRec's packed layout: each key exactly its length."""
    if v.is_traced(lengths):
        raise ValueError(
            "without capacities=, the layout comes from concrete lengths; under jax.jit "
            "pass capacities=(...) (static per-key sizes) or build the KJT outside jit"
        )
    if not keys:
        return ()
    lens = v.to_host(lengths)
    v.check_lengths_values(lens, num_values)
    caps = [int(x) for x in lens.reshape(len(keys), stride).sum(axis=1)]
    caps[-1] += num_values - sum(caps)  # trailing padding belongs to the last key
    return tuple(caps)


def _repack(vals: np.ndarray, w: np.ndarray | None, lpk: np.ndarray, caps) -> tuple:
    """Moves each key's packed values (ids or id words) into the front of its capacity slot."""
    out_v = np.zeros((sum(caps), *vals.shape[1:]), vals.dtype)
    out_w = None if w is None else np.zeros(sum(caps), np.float32)
    src = np.concatenate([[0], np.cumsum(lpk)]).astype(np.int64)
    dst = np.concatenate([[0], np.cumsum(caps)]).astype(np.int64)
    for k, n in enumerate(lpk):
        out_v[dst[k] : dst[k] + n] = vals[src[k] : src[k] + n]
        if w is not None:
            out_w[dst[k] : dst[k] + n] = w[src[k] : src[k] + n]
    return out_v, out_w


def _narrow(values: Any) -> Any:
    """:func:`narrow_ids` that keeps host (numpy) words on the host."""
    if not isinstance(values, np.ndarray):
        return narrow_ids(values)
    lo, hi = values[..., 0], values[..., 1]
    return np.where((hi == 0) & (lo < 2**31), lo.astype(np.int32), np.int32(-1))


def _concat_values(values: list) -> jax.Array:
    """Ids of several features in one buffer: id words for all if any feature has them."""
    if any(x.ndim == 2 and is_wide(x) for x in values):
        as_words = lambda x: jnp.stack(id_words(jnp.asarray(x)), axis=-1)
        values = [x if x.ndim == 2 else as_words(x) for x in values]
    return jnp.concatenate([jnp.asarray(x) for x in values])


def _concat_parts(keys, parts: list[JaggedTensor], stride, weighted, like) -> KeyedJaggedTensor:
    if not parts:
        return KeyedJaggedTensor.empty_like(like)
    values = _concat_values([p.values() for p in parts])
    lengths = jnp.concatenate([p.lengths() for p in parts])
    weights = jnp.concatenate([p.weights() for p in parts]) if weighted else None
    caps = [p.capacity() for p in parts]
    return KeyedJaggedTensor.from_parts(
        keys, values, lengths, weights, capacities=caps, stride=stride
    )
