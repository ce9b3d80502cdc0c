"""JaggedTensor: one ragged feature with a static capacity."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from . import validation as v
from .bags import checked_lengths
from .capacity import bucket_capacity
from .formatting import jagged_repr
from .ids64 import from_id_words, is_wide


@jax.tree_util.register_pytree_node_class
class JaggedTensor:
    """A ragged batch of ``B`` bags stored in a fixed-capacity buffer.

    ::

        lengths = [1, 2]        values = [5, 7, 1, pad, pad, ...]   (capacity C)
                   |  |                   ^  ^^^^  padding: never read
                 bag0 bag1

    Args:
        values: ``[C, ...]`` ids (integer; ``uint32[C, 2]`` for id words, see
            ``jaxrec.sparse.ids64``) or embeddings (floating). Entries past
            ``sum(lengths)`` are padding and never contribute to a result.
            Without x64, host int64 ids that do not fit int32 become id words.
        weights: optional ``[C]`` floating per-value weights.
        lengths: ``[B]`` integer bag lengths. Give ``lengths`` or ``offsets``.
        offsets: ``[B + 1]`` TorchRec offsets (``[0, cumsum(lengths)]``).
        validate: check values on the host (negative lengths, capacity
            overflow, non-finite weights). ``None`` checks only host inputs
            (numpy arrays, lists), which never forces a device-to-host copy.
            Unchecked device inputs follow ``jaxrec.sparse.bags`` in lookups.

    Example:
        >>> jt = JaggedTensor(values=[5, 7, 1], lengths=[1, 2])
        >>> jt.offsets().tolist()
        [0, 1, 3]
    """

    __slots__ = ("_values", "_lengths", "_weights")

    def __init__(
        self,
        values: npt.ArrayLike,
        weights: npt.ArrayLike | None = None,
        lengths: npt.ArrayLike | None = None,
        offsets: npt.ArrayLike | None = None,
        *,
        validate: bool | None = None,
    ):
        if lengths is None:
            if offsets is None:
                raise ValueError("JaggedTensor needs lengths or offsets; pass lengths=[...]")
            lengths = v.lengths_from_offsets(offsets)
        host = all(v.is_host(x) for x in (values, lengths) if x is not None)
        host_weights = weights is not None and v.is_host(weights)
        values = v.as_values_array(values, "values")
        lengths = v.as_int_array(lengths, "lengths")
        if values.ndim < 1:
            raise ValueError(f"values must be at least 1-D, got {values.shape=}")
        v.check_rank(lengths, 1, "lengths")
        if weights is not None:
            weights = v.as_float_array(weights, "weights")
            if weights.shape != values.shape[:1]:
                raise ValueError(
                    f"weights must match values' leading size: {weights.shape=} vs {values.shape=}"
                )
        if validate or (validate is None and host):
            v.check_lengths_values(v.to_host(lengths), values.shape[0])
        if weights is not None and (validate or (validate is None and host_weights)):
            v.check_finite_weights(weights)
        self._values, self._lengths, self._weights = values, lengths, weights

    # pytree: arrays are leaves; nothing else is stored.
    def tree_flatten(self):
        return (self._values, self._lengths, self._weights), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        obj = object.__new__(cls)
        obj._values, obj._lengths, obj._weights = children
        return obj

    @classmethod
    def from_parts(
        cls, values: jax.Array, lengths: jax.Array, weights: jax.Array | None = None
    ) -> JaggedTensor:
        """Assembles a JaggedTensor from its leaves, as ``tree_unflatten`` does: the
        cheap constructor for code that already holds a valid layout (a lookup's
        output rows with the input's lengths).

        The arrays are taken as they are: no conversion, no shape or value check
        (``weights`` may be the ids of an ``EmbeddingCollection`` output, as in
        TorchRec; leaves may carry leading dims inside ``shard_map``), so it adds
        nothing to a traced program. Use the constructor for user input.

        Args:
            values: ``[C, ...]`` ids or embeddings.
            lengths: ``[B]`` bag lengths.
            weights: ``[C]`` or None.

        Example:
            >>> jt = JaggedTensor(values=[5, 7, 1], lengths=[1, 2])
            >>> rows = JaggedTensor.from_parts(jnp.ones((3, 4)), jt.lengths())
        """
        return cls.tree_unflatten(None, (values, lengths, weights))

    # ----- accessors (TorchRec names) -----
    def values(self) -> jax.Array:
        """``[C, ...]`` buffer; entries past ``sum(lengths)`` are padding."""
        return self._values

    def lengths(self) -> jax.Array:
        return self._lengths

    def lengths_or_none(self) -> jax.Array:
        return self._lengths

    def offsets(self) -> jax.Array:
        """``[B + 1]`` offsets ``[0, cumsum(lengths)]``, computed in-graph."""
        return lengths_to_offsets(self._lengths)

    def offsets_or_none(self) -> jax.Array:
        return self.offsets()

    def weights(self) -> jax.Array:
        if self._weights is None:
            raise ValueError("this JaggedTensor has no weights; build it with weights=...")
        return self._weights

    def weights_or_none(self) -> jax.Array | None:
        return self._weights

    def capacity(self) -> int:
        """Static length of the values buffer."""
        return self._values.shape[0]

    def num_bags(self) -> int:
        """Static batch size ``B``."""
        return self._lengths.shape[0]

    def valid_mask(self) -> jax.Array:
        """``[C]`` bool, True where a value belongs to a valid bag (not padding).

        Bags with a negative length or running past the capacity are invalid
        (see ``jaxrec.sparse.bags``): their values are False here.
        """
        return self.segment_ids() < self.num_bags()

    def segment_ids(self) -> jax.Array:
        """``[C]`` bag index of each value; padding and invalid bags get ``B`` (out of range)."""
        return segment_ids_from_lengths(self._lengths, self.capacity())

    # ----- conversions -----
    def to_dense(self) -> list[np.ndarray]:
        """Host-side list of the ``B`` bags' values (TorchRec's ``to_dense``)."""
        return _split_host(self._values, self._lengths)

    def to_dense_weights(self) -> list[np.ndarray] | None:
        if self._weights is None:
            return None
        return _split_host(self._weights, self._lengths)

    def to_padded_dense(
        self, desired_length: int | None = None, padding_value: float = 0
    ) -> jax.Array:
        """``[B, N, ...]`` with each bag left-aligned and padded with ``padding_value``.

        ``N`` is ``desired_length`` (longer bags are truncated) or, on the host
        only, the longest bag.
        """
        return _padded(self._values, self._lengths, desired_length, padding_value)

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> jax.Array | None:
        if self._weights is None:
            return None
        return _padded(self._weights, self._lengths, desired_length, padding_value)

    @staticmethod
    def from_dense(
        values: Sequence[npt.ArrayLike],
        weights: Sequence[npt.ArrayLike] | None = None,
        *,
        capacity: int | None = None,
    ) -> JaggedTensor:
        """Builds from a host list of per-bag arrays; capacity is bucketed unless given.

        Example:
            >>> jt = JaggedTensor.from_dense([[5], [7, 1]])
            >>> jt.lengths().tolist(), jt.capacity()
            ([1, 2], 8)
        """
        bags = [np.asarray(x) for x in values]
        lengths = np.array([b.shape[0] for b in bags], dtype=np.int32)
        total = int(lengths.sum())
        cap = bucket_capacity(total) if capacity is None else capacity
        if total > cap:
            raise ValueError(f"the bags hold {total} values but capacity={cap}; raise capacity")
        flat = _pad_to(np.concatenate(bags) if bags else np.zeros(0, np.int32), cap)
        w = None
        if weights is not None:
            ws = [np.asarray(x, np.float32).reshape(-1) for x in weights]
            if [x.shape[0] for x in ws] != lengths.tolist():
                raise ValueError(
                    f"weights must have one entry per id of each bag: bag lengths "
                    f"{lengths.tolist()}, weight lengths {[x.shape[0] for x in ws]}"
                )
            w = _pad_to(np.concatenate(ws) if ws else np.zeros(0, np.float32), cap)
        return JaggedTensor(values=flat, lengths=lengths, weights=w)

    @staticmethod
    def from_dense_lengths(
        values: npt.ArrayLike, lengths: npt.ArrayLike, weights: npt.ArrayLike | None = None
    ) -> JaggedTensor:
        """From a padded ``[B, N, ...]`` array and ``[B]`` lengths (jit-able; capacity ``B*N``)."""
        values = jnp.asarray(values)
        lengths = v.as_int_array(lengths, "lengths")
        b, n = values.shape[:2]
        lengths = jnp.minimum(lengths, n)
        mask = jnp.arange(n)[None, :] < lengths[:, None]
        dest = jnp.where(mask, lengths_to_offsets(lengths)[:-1, None] + jnp.arange(n), b * n)
        dest = dest.reshape(-1)
        flat = jnp.zeros((b * n, *values.shape[2:]), values.dtype)
        flat = flat.at[dest].set(values.reshape(b * n, *values.shape[2:]), mode="drop")
        w = None
        if weights is not None:
            w = jnp.zeros((b * n,), jnp.asarray(weights).dtype)
            w = w.at[dest].set(jnp.asarray(weights).reshape(-1), mode="drop")
        return JaggedTensor(values=flat, lengths=lengths, weights=w)

    def __repr__(self) -> str:
        if any(v.is_traced(x) for x in (self._values, self._lengths)):
            return f"JaggedTensor(capacity={self.capacity()}, num_bags={self.num_bags()}, traced)"
        w = None if self._weights is None else np.asarray(self._weights)
        values = np.asarray(self._values)
        if values.ndim == 2 and is_wide(values):  # id words: print the 64-bit ids
            values = from_id_words(values, signed=True)
        return jagged_repr(values, np.asarray(self._lengths), w)


def lengths_to_offsets(lengths: jax.Array) -> jax.Array:
    zero = jnp.zeros((1,), lengths.dtype)
    return jnp.concatenate([zero, jnp.cumsum(lengths, dtype=lengths.dtype)])


def segment_ids_from_lengths(lengths: jax.Array, capacity: int) -> jax.Array:
    """``[capacity]`` bag index of each position; positions past the total get ``B``.

    Positions of invalid bags (negative length, or past ``capacity``: see
    ``jaxrec.sparse.bags``) get ``B`` too.
    """
    lengths = checked_lengths(lengths, (capacity,), lengths.shape[0])
    return segment_ids_from_ends(jnp.cumsum(lengths), capacity)


def segment_ids_from_ends(ends: jax.Array, capacity: int) -> jax.Array:
    """Number of bag ends ``<= p`` for each position ``p`` (a sorted ``searchsorted``).

    A scatter of ones at the ends plus a cumsum: O(capacity), about 2x faster
    than ``jnp.searchsorted`` on CPU. Empty bags (repeated ends) are handled.
    """
    ends = jnp.minimum(ends, capacity).astype(jnp.int32)
    marks = jnp.zeros((capacity + 1,), jnp.int32).at[ends].add(1)
    return jnp.cumsum(marks)[:capacity]


def _split_host(x: npt.ArrayLike, lengths: npt.ArrayLike) -> list[np.ndarray]:
    x, lengths = v.to_host(x), v.to_host(lengths)
    if lengths.size == 0:
        return []  # np.split would return one empty piece
    return np.split(x[: int(lengths.sum())], np.cumsum(lengths)[:-1])


def _pad_to(x: np.ndarray, cap: int) -> np.ndarray:
    out = np.zeros((cap, *x.shape[1:]), x.dtype)
    out[: x.shape[0]] = x
    return out


def _padded(values, lengths, desired_length, padding_value) -> jax.Array:
    if desired_length is None:
        desired_length = int(v.to_host(lengths).max(initial=0))
    n = desired_length
    starts = lengths_to_offsets(lengths)[:-1]
    idx = starts[:, None] + jnp.arange(n)[None, :]
    mask = jnp.arange(n)[None, :] < lengths[:, None]
    rows = jnp.take(values, jnp.where(mask, idx, 0), axis=0, mode="clip")
    mask = mask.reshape(mask.shape + (1,) * (values.ndim - 1))
    return jnp.where(mask, rows, jnp.asarray(padding_value, values.dtype))
