"""Host builders of variable-batch-per-key (VBE) batches: deduplicate, pad, expand.

A VBE ``KeyedJaggedTensor`` holds ``B_k`` bags for key ``k`` and, per key, the
bag of each of the batch's ``B`` samples (``inverse_indices``). A data loader
builds one from a plain batch whose user features repeat per user:
:func:`dedup_features` keeps one bag per user; a pooled lookup then runs on
the distinct users and expands its output to the batch (TorchRec's VBE).

::

    # plain batch, B = 4 samples of 2 users (u0, u1, u0, u1):
    # "user"  [7,8]  [9]  [7,8]  [9]      -> "user"  [7,8]  [9]   B_0 = 2
    # "item"  [3]    [4]  [5,6]  []          "item"  unchanged    B_1 = 4
    #                                        inverse_indices [[0, 1, 0, 1],
    #                                                         [0, 1, 2, 3]]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from . import validation as v
from .keyed_jagged_tensor import Capacities, KeyedJaggedTensor


def dedup_features(
    kjt: KeyedJaggedTensor,
    group_ids: Mapping[str, npt.ArrayLike],
    *,
    stride_per_key: Mapping[str, int] | None = None,
    capacities: Capacities = None,
) -> KeyedJaggedTensor:
    """A VBE batch keeping one bag per distinct group id of each listed key (host).

    Args:
        kjt: a plain (non-VBE) batch of ``B`` samples, on the host or device.
        group_ids: ``{key: [B] integer group of each sample}`` (e.g. the user id
            of each sample): samples of one group must hold the same bag of that
            key. Keys not listed keep all ``B`` bags (identity inverse indices).
        stride_per_key: ``{key: B_k}`` to pad a listed key to ``B_k`` bags (empty
            bags no sample reads), so that batches share one shape and a jitted
            step traces once; at least the number of distinct groups.
        capacities: the result's capacities (default: bucketed, as
            ``from_lengths_sync``; a key's ids shrink with its bags).

    Returns:
        A VBE ``KeyedJaggedTensor`` (numpy leaves) whose key ``k`` holds its
        groups' bags in order of first appearance; ``stride()`` is ``B``.

    Raises:
        ValueError: a key is unknown, ``group_ids`` has the wrong shape, two
            samples of one group hold different bags, or a padded stride is
            below the number of groups.

    Example:
        >>> kjt = KeyedJaggedTensor(["user"], [7, 8, 9, 7, 8], lengths=[2, 1, 2])
        >>> vbe = dedup_features(kjt, {"user": [10, 11, 10]})
        >>> vbe.stride_per_key(), vbe.inverse_indices()[1].tolist()
        ([2], [[0, 1, 0]])
    """
    if kjt.variable_stride_per_key():
        raise ValueError("dedup_features takes a plain batch; this one already has VBE strides")
    keys, b = kjt.keys(), kjt.stride()
    unknown = sorted(set(group_ids) - set(keys))
    if unknown:
        raise ValueError(f"group_ids names keys {unknown} that the batch lacks; keys are {keys}")
    pads = dict(stride_per_key or {})
    if set(pads) - set(group_ids):
        raise ValueError(
            f"stride_per_key names keys {sorted(set(pads) - set(group_ids))} without group_ids"
        )
    values, lengths, weights, strides, inverse = [], [], [], [], []
    for key in keys:
        jt = kjt[key]
        lens = v.to_host(jt.lengths()).astype(np.int64)
        ends = np.cumsum(lens)
        ids = v.to_host(jt.values())[: int(ends[-1]) if b else 0]
        w = jt.weights_or_none()
        w = None if w is None else v.to_host(w)[: len(ids)]
        bags = [ids[e - n : e] for e, n in zip(ends, lens, strict=True)]
        if key not in group_ids:
            keep, inv = np.arange(b), np.arange(b)
        else:
            keep, inv = _groups(key, group_ids[key], b, bags, w, ends, lens)
        n = int(pads.get(key, len(keep)))
        if n < len(keep):
            raise ValueError(
                f"stride_per_key[{key!r}]={n} is below the batch's {len(keep)} distinct groups"
            )
        for i in keep:
            values.append(bags[i])
            if w is not None:
                weights.append(w[ends[i] - lens[i] : ends[i]])
        lengths.append(np.concatenate([lens[keep], np.zeros(n - len(keep), np.int64)]))
        strides.append(n)
        inverse.append(inv)
    return KeyedJaggedTensor.from_lengths_sync(
        keys,
        _cat(values, ids_like=v.to_host(kjt.values())),
        np.concatenate(lengths) if lengths else np.zeros(0, np.int64),
        None if kjt.weights_or_none() is None else _cat(weights, np.float32),
        capacities=capacities,
        on_host=True,
        stride_per_key=strides,
        inverse_indices=np.stack(inverse).astype(np.int32) if keys else np.zeros((0, b), np.int32),
    )


def _groups(key, groups, b, bags, w, ends, lens):
    """``(kept sample per group, group of each sample)``, checking the groups' bags agree."""
    g = v.to_host(groups)
    if g.shape != (b,) or not np.issubdtype(g.dtype, np.integer):
        raise ValueError(
            f"group_ids[{key!r}] must be [B] = [{b}] integers, got {g.dtype} {g.shape}"
        )
    _, keep, inv = np.unique(g, return_index=True, return_inverse=True)
    order = np.argsort(keep)  # groups in order of first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    keep, inv = keep[order], rank[inv.reshape(-1)]
    for s in range(b):
        first = keep[inv[s]]
        same = np.array_equal(bags[s], bags[first])
        if same and w is not None:
            same = np.array_equal(
                w[ends[s] - lens[s] : ends[s]], w[ends[first] - lens[first] : ends[first]]
            )
        if not same:
            raise ValueError(
                f"samples {first} and {s} share group {g[s]} of key {key!r} but hold different "
                "bags; group_ids must group samples whose bags of that key are equal"
            )
    return keep, inv


def expand_vbe(kjt: KeyedJaggedTensor, *, capacities: Capacities = None) -> KeyedJaggedTensor:
    """The plain batch of a VBE batch (host): every key's bag per sample, ``B`` bags each.

    Sample ``b`` of key ``k`` gets bag ``inverse_indices[k, b]``; the result is
    what :func:`dedup_features` started from (the reference a VBE lookup equals).
    A plain batch is returned as it is.
    """
    if not kjt.variable_stride_per_key():
        return kjt
    keys, inv = kjt.inverse_indices()
    inv = v.to_host(inv)
    values, lengths, weights = [], [], []
    for k, key in enumerate(keys):
        jt = kjt[key]
        lens = v.to_host(jt.lengths()).astype(np.int64)
        ends = np.cumsum(lens)
        ids = v.to_host(jt.values())
        w = jt.weights_or_none()
        for i in inv[k]:
            values.append(ids[ends[i] - lens[i] : ends[i]])
            if w is not None:
                weights.append(v.to_host(w)[ends[i] - lens[i] : ends[i]])
        lengths.append(lens[inv[k]])
    return KeyedJaggedTensor.from_lengths_sync(
        keys,
        _cat(values, ids_like=v.to_host(kjt.values())),
        np.concatenate(lengths) if lengths else np.zeros(0, np.int64),
        None if kjt.weights_or_none() is None else _cat(weights, np.float32),
        capacities=capacities,
        on_host=True,
    )


def pad_strides(kjt: KeyedJaggedTensor, stride_per_key: Sequence[int]) -> KeyedJaggedTensor:
    """A VBE batch with key ``k`` padded to ``stride_per_key[k]`` bags (host): empty
    bags that no sample reads, so that several batches (a mesh's devices) share one
    shape. Values and capacities stay."""
    spk = [int(x) for x in stride_per_key]
    have = kjt.stride_per_key()
    if len(spk) != len(have) or any(n < h for n, h in zip(spk, have, strict=True)):
        raise ValueError(
            f"pad_strides: stride_per_key {spk} must give every key at least its {have} bags"
        )
    if spk == have and kjt.variable_stride_per_key():
        return kjt
    keys = kjt.keys()
    lens = v.to_host(kjt.lengths())
    offs = kjt.bag_offsets()
    lengths = np.concatenate(
        [
            np.concatenate([lens[offs[k] : offs[k + 1]], np.zeros(spk[k] - have[k], lens.dtype)])
            for k in range(len(keys))
        ]
        or [np.zeros(0, np.int32)]
    )
    inv = kjt.inverse_indices_or_none()
    inverse = (
        v.to_host(inv[1])
        if inv is not None
        else np.tile(np.arange(kjt.stride(), dtype=np.int32), (len(keys), 1))
    )
    w = kjt.weights_or_none()
    return KeyedJaggedTensor.from_parts(
        keys,
        v.to_host(kjt.values()),
        lengths.astype(np.int32),
        None if w is None else v.to_host(w),
        capacities=kjt.capacity_per_key(),
        stride=kjt.stride(),
        stride_per_key=spk,
        inverse_indices=inverse.astype(np.int32),
    )


def _cat(
    parts: list, dtype: npt.DTypeLike | None = None, ids_like: np.ndarray | None = None
) -> np.ndarray:
    if parts:
        return np.concatenate(parts)
    if ids_like is not None:
        return np.zeros((0, *ids_like.shape[1:]), ids_like.dtype)
    return np.zeros(0, dtype)
