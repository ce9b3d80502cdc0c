"""The sharded collections' one-pass bounds check against a per-feature numpy count."""

import numpy as np

import jaxrec as jr
from jaxrec.distributed.id_checks import check_sharded_ids
from jaxrec.xla.bounds import BoundsCheckMode, collect_checks


def _kjt():
    # f1: bags [0, 9], [12]; f2: bags [3], [-1, 4]; f3 (unchecked): [100]; capacity 4 each
    return jr.KeyedJaggedTensor.from_lengths_sync(
        ["f1", "f2", "f3"],
        [0, 9, 12, 3, -1, 4, 100],
        [2, 1, 1, 2, 1, 0],
        capacities={"f1": 4, "f2": 4, "f3": 4},
    )


def test_counts_and_first_bad_id_per_feature_and_table():
    pairs = [("f1", "t1", 10), ("f2", "t2", 4), ("f1", "t3", 13)]  # f1 read by two tables
    with collect_checks(warnings=True) as checks:
        check_sharded_ids(_kjt(), pairs, BoundsCheckMode.WARNING)
        reports = {r.where: (r.count, r.example) for r in checks.warning}
    ids = {"f1": [0, 9, 12], "f2": [3, -1, 4]}
    for feature, table, rows in pairs:
        bad = [i for i in ids[feature] if not 0 <= i < rows]
        count, example = reports[f"sharded lookup of {feature!r} in table {table!r}"]
        assert int(count) == len(bad)
        if bad:
            assert int(example) == bad[0]
    assert len(reports) == len(pairs)


def test_an_empty_batch_reports_nothing():
    kjt = jr.KeyedJaggedTensor.from_lengths_sync(["f1"], np.zeros(0, np.int32), [])
    with collect_checks(warnings=True) as checks:
        check_sharded_ids(kjt, [("f1", "t1", 10)], BoundsCheckMode.WARNING)
    assert checks.warning == []
