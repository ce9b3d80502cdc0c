"""device_rows: what the slots hold while prepared batches are not loaded, against a
simulation of the device's moves."""

import numpy as np
import pytest

from jaxrec.cache.slots import Move
from jaxrec.cache.unloaded import device_rows


@pytest.mark.parametrize("seed", range(6))
def test_device_rows_match_a_simulated_device(seed):
    rng = np.random.default_rng(seed)
    slots, rows = 40, 1000
    used = int(rng.integers(0, slots))
    device = dict(zip(range(used), rng.choice(rows, used, replace=False).tolist(), strict=True))
    maps = dict(device)  # prepare changes the maps at once; the device waits for loads
    later = []
    for _ in range(int(rng.integers(0, 5))):
        cached = list(maps)
        victims = rng.choice(cached, int(rng.integers(0, len(cached) + 1)), replace=False)
        fresh = list(range(len(maps), min(slots, len(maps) + int(rng.integers(0, 6)))))
        fill_slots = np.array([*victims.tolist(), *fresh], np.int64)
        free_rows = np.setdiff1d(np.arange(rows), list(maps.values()))
        fill_rows = rng.choice(free_rows, len(fill_slots), replace=False).astype(np.int64)
        evict_slots = np.sort(victims).astype(np.int64)
        evict_rows = np.array([maps[s] for s in evict_slots], np.int64)
        maps.update(zip(fill_slots.tolist(), fill_rows.tolist(), strict=True))
        later.append(Move(fill_slots, fill_rows, evict_slots, evict_rows))
    s = np.array(list(maps), np.int64)
    r = np.array([maps[x] for x in s.tolist()], np.int64)
    got_s, got_r = device_rows(s, r, later)
    assert dict(zip(got_s.tolist(), got_r.tolist(), strict=True)) == device
    assert len(got_s) == len(device)  # each slot once
