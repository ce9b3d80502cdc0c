"""InFlight: the counts of evictions not back on the host, by prepared batch."""

from types import SimpleNamespace

import numpy as np
import pytest

from jaxrec.cache.inflight import MAX_BATCHES, InFlight
from jaxrec.cache.slots import Move

NONE = np.zeros(0, np.int64)


def _table(key, lo, hi):
    return SimpleNamespace(key=key, host=SimpleNamespace(rows=(lo, hi)))


def _evicts(*rows):
    return {"t": Move(NONE, NONE, NONE, np.array(rows, np.int64))}


def _fills(*rows):
    return {"t": Move(NONE, np.array(rows, np.int64), NONE, NONE)}


def test_late_fills_follow_the_batches_in_flight():
    f = InFlight([_table("t", 10, 20)], counting=True)  # host rows [10, 20) held here
    assert f.late(_fills(11)) is None  # nothing in flight
    f.add(1, _evicts(11, 12))
    f.add(2, _evicts(12))
    np.testing.assert_array_equal(f.late(_fills(11, 12, 13))["t"], [True, True, False])
    assert f.counts["t"][2] == 2 and len(f) == 2
    f.release(1)
    np.testing.assert_array_equal(f.late(_fills(11, 12))["t"], [False, True])
    f.release(2)
    assert not f.counts["t"].any() and len(f) == 0 and f.late(_fills(12)) is None


def test_invariants_are_checked():
    f = InFlight([_table("t", 0, 8)], counting=True)
    f.add(2, _evicts(1))
    with pytest.raises(RuntimeError, match="recorded after"):
        f.add(2, _evicts(3))  # serials ascend
    f.counts["t"][1] = 0  # a count lost: the release would go below zero
    with pytest.raises(RuntimeError, match="counted out twice"):
        f.release(2)


def test_room_and_the_in_place_path():
    f = InFlight([_table("t", 0, 8)], counting=True)
    for s in range(1, MAX_BATCHES + 1):
        f.add(s, _evicts())
    with pytest.raises(ValueError, match=f"{MAX_BATCHES} prepared batches"):
        f.check_room()
    g = InFlight([_table("t", 0, 8)], counting=False)  # in place: nothing is ever late
    g.add(1, _evicts(1))
    assert len(g) == 0 and g.late(_fills(1)) is None
