"""ShardedEmbeddingCollection: an EmbeddingCollection (sequence lookups) over a device mesh."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, Unpack

import jax
import jax.numpy as jnp

from ..ops import grouped_sequence_lookup
from ..sparse import JaggedTensor
from ..xla.backward import sequence_row_grads
from .sharded_base import SequenceShardedCollection, ShardOptions, ShardSource
from .types import ParameterSharding


class SequenceSource(ShardSource, Protocol):
    """What :class:`ShardedEmbeddingCollection` reads of the module it shards (an
    ``EmbeddingCollection`` or a quantized one)."""

    def need_indices(self) -> bool: ...


class ShardedEmbeddingCollection(SequenceShardedCollection):
    """An ``EmbeddingCollection`` sharded per a plan over ``mesh`` (all its axes).

    The same exchange as :class:`ShardedEmbeddingBagCollection`; the shard
    returns one row (or row slice, for column shards) per id, in the order the
    ids arrived, and the device that owns the id puts it in place. Input: a batch-sharded KJT from
    :func:`jaxrec.distributed.shard_batch`. Output: ``{embedding_name:
    JaggedTensor}`` stacked like the input, one local JaggedTensor per device:
    values ``[world, C_k, D]``, lengths ``[world, B]`` (and the ids as weights
    with ``need_indices``), sharded over the first axis. Device ``d``'s
    JaggedTensor equals the unsharded module's output on device ``d``'s batch;
    use ``jax.vmap`` (e.g. over ``to_padded_dense``) for per-device views.

    Args: as :class:`ShardedEmbeddingBagCollection` (``ec`` is the unsharded module;
    ``qcomms`` sets the precision of the returned rows and their gradients).
    """

    def __init__(
        self,
        ec: SequenceSource,
        plan: Mapping[str, ParameterSharding],
        mesh: jax.sharding.Mesh,
        **options: Unpack[ShardOptions],
    ):
        self._need_indices = ec.need_indices()
        self.output_keys = tuple(f for t in ec.table_configs for f in t.feature_names)
        super().__init__(ec, plan, mesh, **options)

    def embedding_configs(self):
        return list(self.table_configs)

    def need_indices(self) -> bool:
        return self._need_indices

    # ----- hooks: one [C_k, D] array per output embedding and device -----
    def _caps(self, kjt):
        return dict(zip(kjt.keys(), kjt.capacity_per_key(), strict=True))

    def _new_output(self, kjt):
        caps = self._caps(kjt)
        return [
            jnp.zeros((caps[k], d), jnp.float32)
            for k, d in zip(self.output_keys, self.layout.dims, strict=True)
        ]

    def _output_value(self, out):
        return tuple(out)

    def _add_block(self, out, kjt, slot, ncols, block):
        o, c = slot.output, slot.col0
        out[o] = out[o].at[:, c : c + ncols].add(block)

    def _read_block(self, g, kjt, slot, ncols, b):
        return g[slot.output][:, slot.col0 : slot.col0 + ncols].astype(jnp.float32)

    def _dp_lookup(self, table, kjt, rg, out):
        rows = grouped_sequence_lookup(
            table,
            kjt,
            rg.slots,
            bounds_check_mode=self.bounds_check_mode,
            implementation=self.implementation,
        )
        for o, r in zip(self._dp_outputs(rg), rows, strict=True):
            out[o] = r.astype(jnp.float32)

    def _dp_row_grads(self, g, kjt, rg):
        return sequence_row_grads([g[o] for o in self._dp_outputs(rg)], kjt, rg.slots)

    def _finish(self, values, features):
        world = self.layout.world_size
        keys, caps = features.keys(), features.capacity_offsets()
        b = features.stride()
        lengths = features.lengths().reshape(world, -1)
        ids = features.values().reshape(world, -1)
        out = {}
        for name, key, v in zip(self.embedding_names, self.output_keys, values, strict=True):
            k = keys.index(key)
            jt_ids = ids[:, caps[k] : caps[k + 1]] if self._need_indices else None
            out[name] = JaggedTensor.from_parts(
                v.reshape(world, -1, v.shape[-1]).astype(self.dtype),
                lengths[:, k * b : (k + 1) * b],
                jt_ids,
            )
        return out
