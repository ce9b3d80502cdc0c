"""Static checks of a variable batch per key (VBE): strides, inverse indices."""

from __future__ import annotations

from collections.abc import Iterable
from typing import SupportsInt

import jax.numpy as jnp
import numpy as np

from . import validation as v


def check_strides(keys: tuple[str, ...], stride_per_key: Iterable[SupportsInt]) -> tuple[int, ...]:
    spk = tuple(int(x) for x in stride_per_key)
    if len(spk) != len(keys) or any(x < 0 for x in spk):
        raise ValueError(
            f"stride_per_key needs one non-negative batch size per key: {len(keys)} keys, got {spk}"
        )
    return spk


def resolve_vbe(keys, stride_per_key, inverse_indices, stride) -> tuple:
    """``(stride_per_key, inverse_indices int32 [F, B])`` of a VBE batch, ``(None, None)``."""
    if stride_per_key is None and inverse_indices is None:
        return None, None
    if stride_per_key is None or inverse_indices is None:
        raise ValueError(
            "a variable batch per key (VBE) needs both stride_per_key=(B_k per key) and "
            "inverse_indices=[F, B] (each sample's bag per key)"
        )
    spk = check_strides(keys, stride_per_key)
    if isinstance(inverse_indices, tuple):  # TorchRec's (keys, tensor)
        inv_keys, inverse_indices = inverse_indices
        if tuple(inv_keys) != keys:
            raise ValueError(
                f"inverse_indices keys {list(inv_keys)} must be the KJT's keys {list(keys)}"
            )
    inv = v.as_int_array(inverse_indices, "inverse_indices")
    if inv.ndim != 2 or inv.shape[0] != len(keys):
        raise ValueError(f"inverse_indices must be [F, B] = [{len(keys)}, batch], got {inv.shape=}")
    if stride is not None and stride != inv.shape[1]:
        raise ValueError(f"stride={stride} must equal inverse_indices' batch {inv.shape[1]}")
    return spk, inv.astype(jnp.int32) if not isinstance(inv, np.ndarray) else inv


def check_inverse(keys, spk, inverse) -> None:
    """Host check: every sample's bag ``inverse[k, b]`` lies in ``[0, B_k)``."""
    inv = v.to_host(inverse)
    for k, n in enumerate(spk):
        row = inv[k]
        if row.size and (row.min() < 0 or row.max() >= n):
            raise ValueError(
                f"inverse_indices of key {keys[k]!r} must lie in [0, {n}) (its stride_per_key), "
                f"got values in [{row.min()}, {row.max()}]"
            )


def host_length_per_key(lens: np.ndarray, num_keys: int, stride) -> np.ndarray:
    """``[F]`` host sums of key-major lengths; ``stride``: ``B`` or one per key (VBE)."""
    if isinstance(stride, int | np.integer):
        return lens.reshape(num_keys, int(stride)).sum(axis=1)
    key_of = np.repeat(np.arange(num_keys), stride)
    return np.bincount(key_of, weights=lens.astype(np.float64), minlength=num_keys).astype(np.int64)
