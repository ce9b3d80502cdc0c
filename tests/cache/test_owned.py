"""Owned planning (``jaxrec/cache/owned.py``) in one process: two processes' owners
simulated, against the one-process path planning every shard on the whole batch
(``ids.plan_table`` / ``ids.touch``). Their slots and their maps must be equal,
batch after batch; the two-process test (``test_cache_multiprocess.py``) runs the
same functions across real processes."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxrec.cache import CacheAlgorithm, owned
from jaxrec.cache.ids import CachedTable, plan_table, touch
from jaxrec.cache.slots import SlotMap
from jaxrec.checkpoint.layout import Buffer
from jaxrec.embedding.blocks import Block

ROWS, SHARDS, SLOTS = 400, 4, 40
SHARD_ROWS = ROWS // SHARDS
OWNERS = np.array([0, 1, 0, 1])  # interleaved: each process owns non-adjacent shards


def table(algorithm, owner=None) -> CachedTable:
    """The table as process ``owner`` sees it (its shards' maps only); None: all."""
    maps = [
        SlotMap(SHARD_ROWS, SLOTS, algorithm) if owner in (None, OWNERS[s]) else None
        for s in range(SHARDS)
    ]
    host = SimpleNamespace(config=SimpleNamespace(num_embeddings=ROWS))
    return CachedTable("t", "t", host, ("f",), SHARD_ROWS, SLOTS, maps, OWNERS)


def parts_of(rng, n_parts):
    """Zipf-like ids, a few out of range (-1 and ROWS stay out of range)."""
    out = []
    for _ in range(n_parts):
        ids = np.minimum(rng.zipf(1.2, 30) - 1, ROWS - 1)
        ids = rng.permutation(ROWS)[ids]
        ids[rng.random(30) < 0.05] = -1
        ids[rng.random(30) < 0.05] = ROWS
        out.append(ids.astype(np.int32))
    return out


@pytest.mark.parametrize("algorithm", [CacheAlgorithm.LRU, CacheAlgorithm.LFU])
def test_two_owners_plan_as_one_process(algorithm):
    rng = np.random.default_rng(0)
    ref = table(algorithm)
    mine = [table(algorithm, 0), table(algorithm, 1)]
    for _ in range(8):
        parts = [parts_of(rng, 2), parts_of(rng, 3)]  # process 0's, process 1's
        # one process: every shard, the whole batch
        flat = [p for ps in parts for p in ps]
        want = [np.empty_like(p) for p in flat]
        n_ids, plans = plan_table(ref, flat, None)
        for m, plan in zip(ref.maps, plans, strict=True):
            m.assign(plan)
        for p, o in zip(flat, want, strict=True):
            touch(ref, p, o, False)
        # two processes: ids to owners, owners plan and assign, slots back
        routes = [owned.route(mine[q], parts[q], 2) for q in range(2)]
        received = [[routes[q][0][routes[q][1][o]] for q in range(2)] for o in range(2)]
        got_ids = 0
        for o in range(2):
            n, plans = owned.plan_shards(mine[o], received[o])
            got_ids += n
            for m, plan in zip(mine[o].maps, plans, strict=True):
                if m is not None:
                    m.assign(plan)
        back = [owned.slots_of(mine[o], received[o]) for o in range(2)]
        outs = [[np.empty_like(p) for p in parts[q]] for q in range(2)]
        for q in range(2):
            ids, sent = routes[q]
            owned.place(mine[q], ids, sent, [back[o][q] for o in range(2)], outs[q])
        assert got_ids == n_ids
        for w, g in zip(want, [o for os in outs for o in os], strict=True):
            np.testing.assert_array_equal(g, w)
        for s in range(SHARDS):
            a, b = ref.maps[s], mine[OWNERS[s]].maps[s]
            for field in ("slot_of_row", "row_of_slot", "last_used"):
                np.testing.assert_array_equal(getattr(b, field), getattr(a, field))
            if algorithm is CacheAlgorithm.LFU:
                np.testing.assert_array_equal(b.counts, a.counts)
    assert all(m.used for m in ref.maps)  # every shard was filled


def test_ids_of_a_shard_not_owned_are_refused():
    t = table(CacheAlgorithm.LRU, 0)
    with pytest.raises(ValueError, match="does not own; every process must build the same"):
        owned.plan_shards(t, [np.array([150], np.int32)])  # shard 1: process 1's


def test_owners_from_the_devices():
    # an unsharded table's buffer on this process's device: one shard, owned here
    arr = jax.numpy.zeros((SLOTS, 4))
    block = Block(table="t", row=0, rows=SLOTS, col=0, cols=4, start=0)
    buffer = Buffer("weight", arr, (block,), ("tables", ("t",)))
    assert owned.shard_owners([buffer], "t", SLOTS, 1).tolist() == [jax.process_index()]
