"""The bounds check of a sharded collection's ids, one pass over the whole KJT.

No shard holds an out-of-range id, so it would silently drop: every feature of a
sharded table is checked against its table's rows. Checking feature by feature
traced a check (and a report) per feature, hundreds of them for a large model;
here each position's bound comes from its key (``segment_ids // B``), so the check
is a few array ops over the KJT, however many features there are.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..sparse import KeyedJaggedTensor
from ..xla.bounds import BoundsCheckMode, report_out_of_range_many


def check_sharded_ids(
    kjt: KeyedJaggedTensor, pairs: Sequence[tuple[str, str, int]], mode: BoundsCheckMode
) -> None:
    """Reports ids outside ``[0, rows)`` for every ``(feature, table, rows)`` of ``pairs``
    (per ``mode``; messages name the feature and the table)."""
    mode = BoundsCheckMode(mode)
    if mode in (BoundsCheckMode.NONE, BoundsCheckMode.IGNORE) or kjt.stride() == 0:
        return  # an empty batch holds no id
    keys = {k: i for i, k in enumerate(kjt.keys())}
    layers: list[dict[str, tuple[str, int]]] = []  # a feature read by k tables: k layers
    for feature, table, rows in pairs:
        layer = next((x for x in layers if feature not in x), None)
        if layer is None:
            layers.append(layer := {})
        layer[feature] = (table, rows)
    f, b = len(keys), kjt.stride()
    ids = kjt.values()
    info = jnp.iinfo(ids.dtype)
    top = min(int(info.max), int(np.iinfo(np.int64).max))
    if kjt.variable_stride_per_key():  # the key of each bag, F for padding
        bag_key = np.append(np.repeat(np.arange(f), kjt.stride_per_key()), f).astype(np.int32)
        key = jnp.asarray(bag_key)[kjt.segment_ids()]
    else:
        key = kjt.segment_ids() // b  # F where the position holds no id
    position = jnp.arange(ids.shape[0], dtype=jnp.int32)
    for layer in layers:
        rows = np.zeros(f + 1, np.int64)
        checked = np.zeros(f + 1, bool)
        for feature, (_, n) in layer.items():
            rows[keys[feature]], checked[keys[feature]] = n, True
        limit = np.clip(rows - 1, 0, top).astype(ids.dtype)
        ok = jnp.asarray(rows > 0)[key] & (ids <= jnp.asarray(limit)[key])
        if info.min < 0:
            ok = ok & (ids >= 0)
        bad = jnp.asarray(checked)[key] & ~ok
        counts = jax.ops.segment_sum(bad.astype(jnp.int32), key, num_segments=f + 1)
        first = jax.ops.segment_min(jnp.where(bad, position, ids.shape[0]), key, num_segments=f + 1)
        examples = jnp.take(ids, jnp.minimum(first, max(ids.shape[0] - 1, 0)))
        order = np.asarray([keys[feature] for feature in layer])
        wheres = [f"sharded lookup of {ft!r} in table {t!r}" for ft, (t, _) in layer.items()]
        report_out_of_range_many(counts[order], examples[order], mode, wheres)
