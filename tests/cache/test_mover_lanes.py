"""A move runs in lanes, one per device, each on its own buffer rows: rows replicated
over a mesh axis are filled on every replica and read back once, and a process's host
arrays may hold only its devices' rows (``offsets``), checked before anything moves."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrec.cache import mover
from jaxrec.cache.slots import Move
from jaxrec.checkpoint.layout import Buffer
from jaxrec.embedding.blocks import Block

ROWS, DIM = 16, 4


def _buffer(mesh, spec):
    values = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
    array = jax.device_put(values, NamedSharding(mesh, spec))
    return values, Buffer("weight", array, (Block("t", 0, ROWS, 0, DIM, 0),), ("tables", ("t",)))


def _move(fill_slots, fill_rows, evict_slots, evict_rows):
    return {
        "t": Move(
            *(np.array(x, np.int64) for x in (fill_slots, fill_rows, evict_slots, evict_rows))
        )
    }


def test_replicated_rows_fill_every_replica_and_read_back_once():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    before, buf = _buffer(mesh, P("x", None))  # rows 0-7 on two devices, 8-15 on two
    host = {"t": {"weight": np.random.default_rng(0).normal(size=(40, DIM)).astype(np.float32)}}
    want_host = host["t"]["weight"].copy()
    m = mover.Mover([buf], host)
    assert [(x.lo, x.hi, x.first) for x in m.lanes[0]] == [
        (0, 8, 0),
        (0, 8, 0),
        (8, 16, 2),
        (8, 16, 2),
    ]
    staged = m.stage(_move([1, 9, 12], [3, 5, 7], [1, 9], [20, 30]), host)
    (new,), pending = m.apply([buf.array], staged)
    pending.write_back()
    want = before.copy()
    want[[1, 9, 12]] = host["t"]["weight"][[3, 5, 7]]
    for shard in new.addressable_shards:  # every replica got its fills
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    want_host[[20, 30]] = before[[1, 9]]  # each evicted row written back once
    np.testing.assert_array_equal(host["t"]["weight"], want_host)
    assert len(pending.parts) == 2  # one part per lane that read (not per replica)


def test_host_rows_with_an_offset():
    """Host arrays holding rows [4, 12) only: rows in them move; a move that needs a row
    outside them is refused naming the table and its range."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    before, buf = _buffer(mesh, P("x", None))
    local = np.random.default_rng(1).normal(size=(8, DIM)).astype(np.float32)
    host = {"t": {"weight": local}}
    m = mover.Mover([buf], host, {"t": "big"}, {"t": 4})
    assert not m.inplace
    staged = m.stage(_move([0, 15], [4, 11], [15], [6]), host)
    (new,), pending = m.apply([buf.array], staged)
    pending.write_back()
    want = before.copy()
    want[[0, 15]] = local[[0, 7]]
    np.testing.assert_array_equal(np.asarray(new), want)
    assert np.array_equal(local[2], before[15])  # row 6 is local row 2
    with pytest.raises(ValueError, match=r"'big' holds rows \[4, 12\).*\(2\.\.2\)"):
        m.stage(_move([3], [2], [], []), host)
