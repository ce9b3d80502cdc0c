"""KeyedJaggedTensor: many ragged features in one buffer with static per-key capacities."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.typing import DTypeLike

from . import validation as v
from .bags import checked_lengths
from .capacity import resolve_capacities
from .formatting import keyed_jagged_repr
from .ids64 import from_id_words, id_words, is_wide, narrow_ids
from .jagged_tensor import JaggedTensor, lengths_to_offsets, segment_ids_from_ends
from .strides import check_inverse, check_strides, host_length_per_key, resolve_vbe

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
        stride_per_key: variable batch per feature (TorchRec's VBE): key ``k``
            has ``stride_per_key[k]`` bags (``B_k``, e.g. the distinct users of
            the batch) and ``lengths`` is ``[sum(B_k)]`` key-major. Needs
            ``inverse_indices``; ``stride()`` is then the output batch ``B``.
        inverse_indices: ``int32[F, B]`` (or TorchRec's ``(keys, [F, B])``):
            sample ``b`` of key ``k`` is bag ``inverse_indices[k, b]`` of that
            key, in ``[0, B_k)``. A pooled lookup runs on the ``B_k`` bags and
            expands its output to ``B`` samples with it.

    A VBE batch (``stride_per_key=(2, 3)``, ``B = 3``)::

        #          0       1        2    <-- bags of each key
        # "user"  [7,8]   [9]               B_0 = 2, inverse [0, 1, 0]
        # "item"  [3]     [4]      [5,6]    B_1 = 3, inverse [0, 1, 2]
        # lengths = [2, 1, | 1, 1, 2]                  [sum(B_k)]

    Example:
        >>> kjt = KeyedJaggedTensor(keys=["f1", "f2"], values=[0, 1, 2, 3, 4, 5, 6, 7],
        ...                         lengths=[2, 0, 1, 1, 1, 3])
        >>> kjt["f2"].to_dense()[2].tolist()
        [5, 6, 7]
    """

    __slots__ = ("_keys", "_caps", "_stride", "_spk", "_values", "_lengths", "_weights", "_inverse")
    _keys: tuple[str, ...]
    _caps: tuple[int, ...]
    _stride: int
    _spk: tuple[int, ...] | None  # B_k per key (VBE), else None
    _values: jax.Array
    _lengths: jax.Array
    _weights: jax.Array | None
    _inverse: jax.Array | None

    def __init__(
        self,
        keys: Sequence[str],
        values: npt.ArrayLike,
        weights: npt.ArrayLike | None = None,
        lengths: npt.ArrayLike | None = None,
        offsets: npt.ArrayLike | None = None,
        stride: int | None = None,
        *,
        capacities: Capacities = None,
        validate: bool | None = None,
        stride_per_key: Sequence[int] | None = None,
        inverse_indices: npt.ArrayLike | tuple[Sequence[str], npt.ArrayLike] | None = None,
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
        spk, inverse = resolve_vbe(keys, stride_per_key, inverse_indices, stride)
        if spk is not None:
            stride = int(inverse.shape[1])
            if lengths.shape[0] != sum(spk):
                raise ValueError(
                    f"lengths has {lengths.shape[0]} entries but stride_per_key={spk} "
                    f"sums to {sum(spk)}; a VBE batch's lengths are key-major [sum(B_k)]"
                )
        else:
            stride = _resolve_stride(len(keys), lengths.shape[0], stride)
        if capacities is None:
            caps = _packed_capacities(keys, lengths, spk or stride, values.shape[0])
        else:
            caps = resolve_capacities(keys, None, capacities)  # overflow: validate() below
            if sum(caps) != values.shape[0]:
                raise ValueError(
                    f"sum(capacities)={sum(caps)} must equal the values length {values.shape[0]}"
                )
        self._keys, self._caps, self._stride, self._spk = keys, caps, stride, spk
        self._values, self._lengths, self._weights = values, lengths, weights
        self._inverse = inverse
        if validate:
            self.validate()
        elif validate is None:  # host inputs only: no device-to-host copy
            if host:
                self._check_layout()
                if spk is not None and v.is_host(inverse_indices):
                    check_inverse(keys, spk, inverse)
            if host_weights and weights is not None:  # converted: a jax.Array here
                v.check_finite_weights(weights)

    # ----- pytree -----
    def tree_flatten(self):
        # Children (values, lengths, weights), plus inverse_indices for VBE only: code
        # that unpacks a plain KJT's three children keeps working.
        children = (self._values, self._lengths, self._weights)
        if self._spk is not None:
            children += (self._inverse,)
        return children, (self._keys, self._caps, self._stride, self._spk)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        if len(aux) == 3:  # a plain KJT's aux data as older code builds it
            aux = (*aux, None)
        obj._keys, obj._caps, obj._stride, obj._spk = aux
        obj._values, obj._lengths, obj._weights = children[:3]
        obj._inverse = children[3] if obj._spk is not None else None
        return obj

    @classmethod
    def from_parts(
        cls,
        keys: Sequence[str],
        values: jax.Array | np.ndarray,
        lengths: jax.Array | np.ndarray,
        weights: jax.Array | np.ndarray | None = None,
        *,
        capacities: Sequence[int],
        stride: int,
        stride_per_key: Sequence[int] | None = None,
        inverse_indices: jax.Array | np.ndarray | None = None,
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
            lengths: ``[F * stride]`` bag lengths, key-major (VBE: ``[sum(B_k)]``).
            weights: ``[sum(capacities)]`` or None.
            capacities: per-key capacities, in key order.
            stride: the batch size ``B`` (VBE: the output batch).
            stride_per_key: VBE only: ``B_k`` per key (see the class doc).
            inverse_indices: VBE only: ``int32[F, B]``, given with ``stride_per_key``.

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
        if (stride_per_key is None) != (inverse_indices is None):
            raise ValueError(
                "from_parts: a VBE batch needs both stride_per_key and inverse_indices; "
                f"got {stride_per_key=} and inverse_indices "
                f"{'None' if inverse_indices is None else 'given'}"
            )
        spk = None
        if stride_per_key is not None:
            spk = check_strides(keys, stride_per_key)
        aux = (keys, caps, int(stride), spk)
        return cls.tree_unflatten(aux, (values, lengths, weights, inverse_indices))

    # ----- static metadata -----
    def keys(self) -> list[str]:
        return list(self._keys)

    def stride(self) -> int:
        """The batch size ``B`` (with VBE, the output batch that
        ``inverse_indices`` expands each key's bags to)."""
        return self._stride

    # ----- variable batch per key (TorchRec's VBE) -----
    def variable_stride_per_key(self) -> bool:
        """Whether keys have their own batch sizes (``stride_per_key``)."""
        return self._spk is not None

    def stride_per_key(self) -> list[int]:
        """``B_k`` per key: its number of bags (``stride()`` for every key without VBE)."""
        return list(self._spk) if self._spk is not None else [self._stride] * len(self._keys)

    def inverse_indices(self) -> tuple[list[str], jax.Array]:
        """TorchRec's ``(keys, inverse_indices [F, B])``: sample ``b`` of key ``k`` is
        bag ``inverse_indices[k, b]`` of that key."""
        if self._inverse is None:
            raise ValueError(
                "this KeyedJaggedTensor has no inverse_indices (no variable batch per "
                "key); build it with stride_per_key=... and inverse_indices=..."
            )
        return list(self._keys), self._inverse

    def inverse_indices_or_none(self) -> tuple[list[str], jax.Array] | None:
        return None if self._inverse is None else self.inverse_indices()

    def bag_offsets(self) -> tuple[int, ...]:
        """``[F + 1]`` static start of each key's bags in ``lengths()`` (``k * B``
        without VBE), plus the total number of bags."""
        return tuple(int(x) for x in np.cumsum([0, *self.stride_per_key()]))

    def require_uniform_stride(self, where: str) -> None:
        """Raises ``NotImplementedError`` for a VBE batch: ``where`` reads every key
        at one batch size."""
        if self._spk is not None:
            raise NotImplementedError(
                f"{where} does not take a variable batch per key (VBE: "
                f"stride_per_key={self._spk}); expand it first with "
                "jaxrec.sparse.expand_vbe(kjt), or use an EmbeddingBagCollection"
            )

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
        return KeyedJaggedTensor.tree_unflatten(
            (self._keys, self._caps, self._stride, self._spk),
            (_narrow(self._values), self._lengths, self._weights, self._inverse),
        )

    def lengths(self) -> jax.Array:
        return self._lengths

    def lengths_or_none(self) -> jax.Array:
        return self._lengths

    def offsets(self) -> jax.Array:
        """``[F * B + 1]`` (VBE: ``[sum(B_k) + 1]``) TorchRec offsets
        ``[0, cumsum(lengths)]`` (packed layout)."""
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
        if self._spk is None:
            return self._lengths.reshape(len(self._keys), self._stride).sum(axis=1)
        key_of = np.repeat(np.arange(len(self._keys), dtype=np.int32), self._spk)
        return jax.ops.segment_sum(self._lengths, key_of, num_segments=len(self._keys))

    def offset_per_key(self) -> jax.Array:
        """``[F + 1]`` packed start of each key, ``[0, cumsum(length_per_key)]``."""
        return lengths_to_offsets(self.length_per_key())

    def segment_ids(self) -> jax.Array:
        """``[C]`` global bag index ``k * B + b`` of every value; padding gets ``F * B``.

        With VBE the index is ``bag_offsets()[k] + b`` and padding gets
        ``sum(B_k)``. This is how lookups address this buffer: one sorted
        segment id per value, across all keys. Values of invalid bags (a
        negative length, or past the key's capacity: see ``jaxrec.sparse.bags``)
        get the padding index too, so a key that overflows never spills into
        the next key's bags.
        """
        f = len(self._keys)
        bag0 = np.asarray(self.bag_offsets(), np.int32)
        starts = np.asarray(self.capacity_offsets()[:-1], np.int32)
        key_of = np.repeat(np.arange(f, dtype=np.int32), self._caps)
        local = np.arange(sum(self._caps), dtype=np.int32) - starts[key_of]
        lens = checked_lengths(self._lengths, self._caps, self._spk or self._stride)
        nbags = np.diff(bag0)
        bag_key = np.repeat(np.arange(f, dtype=np.int32), nbags)
        if bag0[-1]:
            # Local bag ends: one running sum, restarted at each key's first bag.
            run = jnp.cumsum(lens)
            first = np.minimum(bag0[:-1], bag0[-1] - 1)
            ends = run - (run - lens)[first][bag_key]
            total = jnp.where(nbags > 0, ends[np.maximum(bag0[1:] - 1, 0)], 0)
        else:
            ends, total = lens, jnp.zeros((f,), lens.dtype)
        seg = segment_ids_from_ends(ends + starts[bag_key], sum(self._caps))
        valid = local < total[key_of]
        return jnp.where(valid, seg, int(bag0[-1]))

    # ----- per-key views -----
    def to_dict(self) -> dict[str, JaggedTensor]:
        """``{key: JaggedTensor}`` by static slicing (no copies of the data layout)."""
        return {k: self[k] for k in self._keys}

    def __getitem__(self, key: str) -> JaggedTensor:
        i = self._key_index(key)
        lo, hi = self.capacity_offsets()[i], self.capacity_offsets()[i + 1]
        b0, b1 = self.bag_offsets()[i : i + 2]
        w = None if self._weights is None else self._weights[lo:hi]
        return JaggedTensor.from_parts(self._values[lo:hi], self._lengths[b0:b1], w)

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
        values: npt.ArrayLike,
        lengths: npt.ArrayLike,
        weights: npt.ArrayLike | None = None,
        stride: int | None = None,
        *,
        capacities: Capacities = None,
        on_host: bool = False,
        stride_per_key: Sequence[int] | None = None,
        inverse_indices: npt.ArrayLike | tuple[Sequence[str], npt.ArrayLike] | None = None,
    ) -> KeyedJaggedTensor:
        """From TorchRec's packed layout; each key gets a bucketed capacity unless given.

        ``stride_per_key`` and ``inverse_indices`` make a variable batch per key
        (VBE, see the class doc): ``lengths`` is then ``[sum(B_k)]``.

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
        spk, inv = resolve_vbe(keys, stride_per_key, inverse_indices, stride)
        if spk is None:
            stride = _resolve_stride(len(keys), lens.shape[0], stride)
        else:
            inv, stride = v.to_host(inv).astype(np.int32), int(inv.shape[1])
            if lens.shape[0] != sum(spk):
                raise ValueError(
                    f"lengths has {lens.shape[0]} entries but stride_per_key={spk} sums to "
                    f"{sum(spk)}; a VBE batch's lengths are key-major [sum(B_k)]"
                )
            check_inverse(keys, spk, inv)
        v.check_lengths_values(lens, vals.shape[0])
        if int(lens.sum()) != vals.shape[0]:  # trailing values would be dropped silently
            raise ValueError(
                f"sum(lengths)={int(lens.sum())} must equal the number of values "
                f"{vals.shape[0]} (TorchRec's packed layout); pass only the ids of the bags"
            )
        lpk = host_length_per_key(lens, len(keys), spk or stride)
        caps = resolve_capacities(keys, lpk.tolist(), capacities)
        w = None if weights is None else np.asarray(v.as_float_array(v.to_host(weights), "weights"))
        if w is not None and w.shape != vals.shape[:1]:
            raise ValueError(f"weights must match values: {w.shape=} vs {vals.shape=}")
        if w is not None:
            v.check_finite_weights(w)
        out_v, out_w = _repack(vals, w, lpk, caps)
        vbe = {"stride_per_key": spk, "inverse_indices": inv}
        if on_host:  # validated above; ids already in their device representation
            return KeyedJaggedTensor.from_parts(
                keys, out_v, lens.astype(np.int32), out_w, capacities=caps, stride=stride, **vbe
            )
        return KeyedJaggedTensor(
            keys,
            out_v,
            out_w,
            lengths=lens,
            stride=stride,
            capacities=caps,
            validate=False,
            **(vbe if spk is None else {**vbe, "inverse_indices": jnp.asarray(inv)}),
        )

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str],
        values: npt.ArrayLike,
        offsets: npt.ArrayLike,
        weights: npt.ArrayLike | None = None,
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
        is_weighted: bool = False, stride: int = 0, values_dtype: DTypeLike = jnp.int32
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
        inverse = None if self._inverse is None else [self._inverse[i] for i in indices]
        return _concat_parts(
            [self._keys[i] for i in indices],
            parts,
            self._stride,
            self._weights is not None,
            self,
            inverse,
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
        b = strides.pop()
        inverse = None
        if any(k.variable_stride_per_key() for k in kjt_list):  # identity rows elsewhere
            same = jnp.arange(b, dtype=jnp.int32)
            inverse = [
                k.inverse_indices()[1][i] if k.variable_stride_per_key() else same
                for k in kjt_list
                for i in range(len(k.keys()))
            ]
        return _concat_parts(keys, parts, b, weighted.pop(), kjt_list[0], inverse)

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
        lpk = host_length_per_key(lens, len(self._keys), self._spk or self._stride)
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
    caps = [int(x) for x in host_length_per_key(lens, len(keys), stride)]
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
        if w is not None and out_w is not None:
            out_w[dst[k] : dst[k] + n] = w[src[k] : src[k] + n]
    return out_v, out_w


def _narrow(values: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
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


def _concat_parts(
    keys, parts: list[JaggedTensor], stride, weighted, like, inverse=None
) -> KeyedJaggedTensor:
    """``inverse``: each part's ``[B]`` inverse indices (VBE), or None."""
    if not parts:
        return KeyedJaggedTensor.empty_like(like)
    values = _concat_values([p.values() for p in parts])
    lengths = jnp.concatenate([p.lengths() for p in parts])
    weights = jnp.concatenate([p.weights() for p in parts]) if weighted else None
    caps = [p.capacity() for p in parts]
    vbe = {}
    if inverse is not None:
        vbe = {
            "stride_per_key": [p.num_bags() for p in parts],
            "inverse_indices": jnp.stack([jnp.asarray(r, jnp.int32) for r in inverse]),
        }
    return KeyedJaggedTensor.from_parts(
        keys, values, lengths, weights, capacities=caps, stride=stride, **vbe
    )
