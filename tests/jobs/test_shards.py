"""Each process's share of the job's global batch stream, and evaluation's padding."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrec.datasets import Table, TableDataset
from jaxrec.jobs import dlrm_parts
from jaxrec.jobs.dlrm_flags import parse_config
from jaxrec.jobs.shards import rank_batches

WORLD, SIZE = 4, 3


def _data(sizes):
    """One table per size; the id of row i (counted over the tables) is i."""
    tables, start = [], 0
    for n in sizes:
        ids = np.arange(start, start + n)
        tables.append(Table(np.zeros((n, 1), np.float32), [ids], ids % 2))
        start += n
    return TableDataset(tables, keys=["f"], num_embeddings_per_feature=[start])


def _ids(batch):
    if batch is None:
        return None
    rows = np.asarray(batch.labels).shape[0]  # one id per row; the rest is padding
    return np.asarray(batch.sparse_features.values())[:rows]


@pytest.mark.parametrize("sizes", [[50], [20, 17, 13]], ids=["one table", "three files"])
def test_processes_split_the_one_process_stream(sizes):
    data = _data(sizes)
    for drop_last in (True, False):
        kw = dict(shuffle=True, seed=3, epoch=1, drop_last=drop_last)
        whole = [[_ids(b) for b in g] for g in rank_batches(data, SIZE, range(WORLD), WORLD, **kw)]
        # Two processes of two devices: together, the same steps and batches.
        halves = [
            [[_ids(b) for b in g] for g in rank_batches(data, SIZE, ranks, WORLD, **kw)]
            for ranks in ([0, 1], [2, 3])
        ]
        assert len(halves[0]) == len(halves[1]) == len(whole)
        for step, group in enumerate(whole):
            got = halves[0][step] + halves[1][step]
            for a, b in zip(got, group, strict=True):
                assert (a is None and b is None) or np.array_equal(a, b)
        seen = np.concatenate([ids for g in whole for ids in g if ids is not None])
        if drop_last:
            assert len(whole) == 50 // (SIZE * WORLD) and len(seen) == len(whole) * SIZE * WORLD
        else:  # every row once, the last step padded with None for ranks without rows
            assert sorted(seen) == list(range(50))


def test_one_table_matches_the_grouped_stream_of_earlier_jobs():
    # Training (drop_last) is unchanged from grouping WORLD consecutive batches.
    data = _data([50])
    stream = list(data.batches(SIZE, shuffle=True, seed=3, epoch=1))
    grouped = [stream[i : i + WORLD] for i in range(0, len(stream) - WORLD + 1, WORLD)]
    got = list(rank_batches(data, SIZE, range(WORLD), WORLD, shuffle=True, seed=3, epoch=1))
    assert len(got) == len(grouped)
    for g, want in zip(got, grouped, strict=True):
        for a, b in zip(g, want, strict=True):
            np.testing.assert_array_equal(_ids(a), _ids(b))


def test_evaluate_counts_ranks_without_rows_as_empty():
    # 5 eval rows over 8 devices: ranks 5-7 get empty batches of weight 0.
    data = _data([5])
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    config = dataclasses.replace(parse_config([]), devices=8, batch_size=2)
    predict = jax.jit(lambda state, batch: 0.25 + 0.5 * batch.labels)  # labels: 0 1 0 1 0
    got = dlrm_parts.evaluate(predict, None, data, config, mesh)
    assert got["ctr"] == pytest.approx(2 / 5) and got["auc"] == 1.0
    assert got["calibration"] == pytest.approx((3 * 0.25 + 2 * 0.75) / 2)
