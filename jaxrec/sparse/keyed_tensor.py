"""KeyedTensor: pooled embeddings of several keys, concatenated along one dim."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import validation as v


@jax.tree_util.register_pytree_node_class
class KeyedTensor:
    """Dense per-key blocks, e.g. ``[B, sum(dims)]`` pooled embeddings.

    ::

        #          "product" (64)   "user" (64)
        # row 0  [ .............. | .......... ]
        # row 1  [ .............. | .......... ]     values: [B=2, 128]

    Args:
        keys: names, unique.
        length_per_key: static width of each key along ``key_dim``.
        values: the concatenated array.
        key_dim: the dimension the keys are concatenated along (1 by default).

    Example:
        >>> kt = KeyedTensor(keys=["a", "b"], length_per_key=[2, 3], values=jnp.zeros((4, 5)))
        >>> kt["b"].shape, kt.offset_per_key()
        ((4, 3), [0, 2, 5])
    """

    __slots__ = ("_keys", "_length_per_key", "_key_dim", "_values")

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values: jax.Array,
        key_dim: int = 1,
    ):
        keys, lpk = tuple(keys), tuple(int(n) for n in length_per_key)
        if len(keys) != len(lpk):
            raise ValueError(f"{len(keys)} keys but {len(lpk)} entries in length_per_key")
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate keys in {list(keys)}")
        values = values if v.is_traced(values) else jnp.asarray(values)
        if not -values.ndim <= key_dim < values.ndim:
            raise ValueError(f"key_dim={key_dim} is out of range for {values.shape=}")
        key_dim %= values.ndim
        if values.shape[key_dim] != sum(lpk):
            raise ValueError(
                f"values.shape[{key_dim}]={values.shape[key_dim]} != sum(length_per_key)={sum(lpk)}"
            )
        self._keys, self._length_per_key, self._key_dim, self._values = keys, lpk, key_dim, values

    def tree_flatten(self):
        return (self._values,), (self._keys, self._length_per_key, self._key_dim)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj._keys, obj._length_per_key, obj._key_dim = aux
        (obj._values,) = children
        return obj

    @staticmethod
    def from_tensor_list(
        keys: Sequence[str], tensors: Sequence[jax.Array], key_dim: int = 1, cat_dim: int = 1
    ) -> KeyedTensor:
        lpk = [t.shape[key_dim] for t in tensors]
        return KeyedTensor(keys, lpk, jnp.concatenate(list(tensors), axis=cat_dim), key_dim)

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> jax.Array:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def length_per_key(self) -> list[int]:
        return list(self._length_per_key)

    def offset_per_key(self) -> list[int]:
        return [0, *np.cumsum(self._length_per_key, dtype=np.int64).tolist()]

    def __getitem__(self, key: str) -> jax.Array:
        try:
            i = self._keys.index(key)
        except ValueError:
            raise KeyError(
                f"{key!r} is not a key of this KeyedTensor; keys are {list(self._keys)}"
            ) from None
        off = self.offset_per_key()
        return jax.lax.slice_in_dim(self._values, off[i], off[i + 1], axis=self._key_dim)

    def to_dict(self) -> dict[str, jax.Array]:
        return {k: self[k] for k in self._keys}

    @staticmethod
    def regroup(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]
    ) -> list[jax.Array]:
        """One concatenated array per group of keys, drawn from several KeyedTensors.

        Example:
            >>> a = KeyedTensor(["x", "y"], [1, 2], jnp.ones((2, 3)))
            >>> b = KeyedTensor(["z"], [4], jnp.zeros((2, 4)))
            >>> [g.shape for g in KeyedTensor.regroup([a, b], [["x", "z"], ["y"]])]
            [(2, 5), (2, 2)]
        """
        lookup = _key_lookup(keyed_tensors)
        out = []
        for group in groups:
            missing = [k for k in group if k not in lookup]
            if missing:
                raise KeyError(f"regroup keys {missing} are in none of the KeyedTensors")
            dims = {lookup[k].key_dim() for k in group}
            if len(dims) != 1:
                raise ValueError(f"group {list(group)} mixes key_dims {sorted(dims)}")
            out.append(jnp.concatenate([lookup[k][k] for k in group], axis=dims.pop()))
        return out

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]], keys: Sequence[str]
    ) -> dict[str, jax.Array]:
        if len(groups) != len(keys):
            raise ValueError(f"{len(groups)} groups but {len(keys)} keys; give one key per group")
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups), strict=True))

    def __repr__(self) -> str:
        if v.is_traced(self._values):
            return f"KeyedTensor(keys={list(self._keys)}, shape={self._values.shape}, traced)"
        if not self._keys:
            return "KeyedTensor()\n"
        lines = [f'    "{k}": {np.asarray(a).tolist()}' for k, a in self.to_dict().items()]
        return "KeyedTensor({\n" + ",\n".join(lines) + "\n})\n"


def _key_lookup(keyed_tensors: Sequence[KeyedTensor]) -> Mapping[str, KeyedTensor]:
    lookup: dict[str, KeyedTensor] = {}
    for kt in keyed_tensors:
        for k in kt.keys():
            if k in lookup:
                raise ValueError(f"key {k!r} appears in more than one KeyedTensor")
            lookup[k] = kt
    return lookup
