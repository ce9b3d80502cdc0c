"""The sharded collections' hooks are abstract: a subclass that leaves one out is refused
when instantiated, naming it (before its constructor runs)."""

import pytest

from jaxrec.distributed import ShardedEmbeddingBagCollection, ShardedEmbeddingCollection
from jaxrec.distributed.sharded_base import (
    PooledShardedCollection,
    SequenceShardedCollection,
    ShardedCollection,
)


class _Shared:
    """Every hook both kinds need, as stubs."""

    def _new_output(self, kjt):
        return []

    def _read_block(self, g, kjt, slot, ncols, b):
        return None

    def _dp_lookup(self, table, kjt, rg, out):
        return None

    def _dp_row_grads(self, g, kjt, rg):
        return None

    def _finish(self, values, features):
        return values


def _refused(cls) -> str:
    with pytest.raises(TypeError, match=cls.__name__) as err:
        cls(None, {}, None)
    return str(err.value)


def test_a_pooled_collection_without_its_group_hooks_is_refused():
    class HalfPooled(_Shared, PooledShardedCollection):
        def _add_group(self, out, kjt, g, received):
            return out

    message = _refused(HalfPooled)
    assert "_group_grads" in message and "_add_group" not in message, message


def test_a_sequence_collection_without_add_block_is_refused():
    class HalfSequence(_Shared, SequenceShardedCollection):
        pass

    message = _refused(HalfSequence)
    assert "_add_block" in message and "_add_group" not in message, message


def test_the_base_names_the_shared_hooks():
    class Bare(PooledShardedCollection):
        pass

    message = _refused(Bare)
    for hook in ("_new_output", "_read_block", "_dp_lookup", "_dp_row_grads", "_finish"):
        assert hook in message, message


def test_the_shipped_collections_are_complete():
    assert ShardedEmbeddingBagCollection.__abstractmethods__ == frozenset()
    assert ShardedEmbeddingCollection.__abstractmethods__ == frozenset()
    assert {"_forward_group", "_row_grads"} <= ShardedCollection.__abstractmethods__
    assert not ShardedEmbeddingBagCollection.sequence and ShardedEmbeddingCollection.sequence
