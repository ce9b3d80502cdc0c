"""TableDataset batching (shuffle, process sharding, capacities, overflow)."""

import chex
import jax
import numpy as np
import pytest

from jaxrec.datasets import Batch, Part, Ragged, Table, TableDataset


def make_table(n, seed=0, start=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, n)
    dense = np.stack([np.arange(start, start + n), rng.random(n)], 1).astype(np.float32)
    return Table(
        dense=dense,
        sparse=[
            np.arange(start, start + n) % 97,  # single id per row
            rng.integers(0, 10, (n, 2)),  # two ids per row
            Ragged.from_lengths(rng.integers(0, 20, lengths.sum()), lengths),
        ],
        labels=(np.arange(start, start + n) % 2).astype(np.int32),
    )


def make_data(n=103, tables=1):
    parts = [make_table(n, seed=i, start=i * n) for i in range(tables)]
    if tables > 1:  # ragged columns need one table
        parts = [Table(t.dense, t.sparse[:2], t.labels) for t in parts]
    keys = ["one", "two", "bag"][: len(parts[0].sparse)]
    return TableDataset(parts, keys=keys, num_embeddings_per_feature=[97, 10, 20][: len(keys)])


def row_ids(batch):
    return np.asarray(batch.dense_features[:, 0]).astype(int)


def test_ragged_take_matches_python():
    lengths = np.array([2, 0, 3, 1])
    r = Ragged.from_lengths(np.arange(6), lengths)
    vals, lens = r.take(np.array([2, 0, 1, 2, 3]))
    assert vals.tolist() == [2, 3, 4, 0, 1, 2, 3, 4, 5]
    assert lens.tolist() == [3, 2, 0, 3, 1]
    with pytest.raises(ValueError, match="offsets end at"):
        Ragged(np.arange(3), np.array([0, 2]))


def test_batch_contents_and_static_capacities():
    data = make_data()
    t = data.tables[0]
    caps = set()
    for b in data.batches(16, shuffle=True, seed=1):
        assert isinstance(b, Batch)
        chex.assert_type([b.dense_features, b.labels], np.float32)
        kjt = b.sparse_features
        caps.add(kjt.capacity_per_key())
        rows = row_ids(b)
        np.testing.assert_array_equal(b.labels, rows % 2)
        assert kjt["one"].values()[: len(rows)].tolist() == (rows % 97).tolist()
        dense_two = np.asarray(kjt["two"].to_dense())
        np.testing.assert_array_equal(dense_two, t.sparse[1][rows])
        for j, r in enumerate(rows):
            lo, hi = t.sparse[2].offsets[r], t.sparse[2].offsets[r + 1]
            assert kjt["bag"].to_dense()[j].tolist() == t.sparse[2].values[lo:hi].tolist()
        assert isinstance(kjt.values(), np.ndarray)
    assert caps == {(16, 32, 48)}  # one shape for every batch
    assert data.max_ids_per_sample == [1, 2, 3]


def test_shuffle_is_deterministic_per_seed_and_epoch():
    data = make_data()
    order = lambda **kw: np.concatenate([row_ids(b) for b in data.batches(10, **kw)])
    a = order(seed=0, epoch=0)
    np.testing.assert_array_equal(a, order(seed=0, epoch=0))
    assert not np.array_equal(a, order(seed=0, epoch=1))
    assert not np.array_equal(a, order(seed=1, epoch=0))
    assert len(set(a.tolist())) == len(a) == 100  # 10 full batches, no repeats
    np.testing.assert_array_equal(order(shuffle=False), np.arange(100))


@pytest.mark.parametrize("tables", [1, 3])
@pytest.mark.parametrize("drop_last", [True, False])
def test_parts_partition_the_data(tables, drop_last):
    data = make_data(n=103, tables=tables)
    seen, counts = [], []
    for p in range(2):
        bs = list(data.batches(8, seed=4, part=Part(p, 2), drop_last=drop_last))
        assert len(bs) == data.num_batches(8, drop_last=drop_last, part=Part(p, 2))
        counts.append(len(bs))
        seen.append(np.concatenate([row_ids(b) for b in bs]))
    assert not set(seen[0]) & set(seen[1])  # disjoint
    total = np.concatenate(seen)
    if drop_last:
        assert counts[0] == counts[1]  # processes step in lockstep
    else:
        assert sorted(total.tolist()) == list(range(data.num_rows))  # every row exactly once


@pytest.mark.parametrize("tables", [1, 3])
@pytest.mark.parametrize("count", [2, 3])
def test_parts_interleaved_are_the_one_part_stream(tables, count):
    # Several tables (files) too: one global order of rows, not one file per process.
    data = make_data(n=101, tables=tables)
    for shuffle in (False, True):
        for epoch in range(3):
            kw = dict(shuffle=shuffle, seed=4, epoch=epoch)
            whole = [row_ids(b) for b in data.batches(8, part=Part(0, 1), **kw)]
            parts = [
                [row_ids(b) for b in data.batches(8, part=Part(p, count), **kw)]
                for p in range(count)
            ]
            steps = min(len(x) for x in parts)
            assert steps == len(whole) // count
            mixed = [parts[p][s] for s in range(steps) for p in range(count)]
            for a, b in zip(mixed, whole, strict=False):
                np.testing.assert_array_equal(a, b)


def test_several_processes_must_name_a_part(monkeypatch):
    data = make_data(n=20)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"part: 2 JAX processes.*Part\(0, 1\)"):
        list(data.batches(4))
    with pytest.raises(ValueError, match="part: 2 JAX processes"):
        data.num_batches(4)
    assert len(list(data.batches(4, part=Part(1, 2)))) == 2
    with pytest.raises(ValueError, match="part: need 0 <= index < count"):
        data.num_batches(4, part=Part(2, 2))


def test_overflow_raises_or_truncates_and_counts():
    lengths = np.array([3, 3, 0, 1])
    data = TableDataset(
        Table(
            np.zeros((4, 0), np.float32), [Ragged.from_lengths(np.arange(7), lengths)], np.zeros(4)
        ),
        keys=["bag"],
        num_embeddings_per_feature=[10],
        max_ids_per_sample={"bag": 1},
    )
    with pytest.raises(ValueError, match="'bag': a batch holds 6 ids but its capacity is 2"):
        next(data.batches(2, shuffle=False))
    bs = list(data.batches(2, shuffle=False, overflow="truncate"))
    assert data.truncated_ids == {"bag": 4}
    assert bs[0].sparse_features.lengths().tolist() == [2, 0]
    assert bs[1].sparse_features.lengths().tolist() == [0, 1]
    b = next(data.batches(2, shuffle=False, capacities=[8]))
    assert b.sparse_features.capacity_per_key() == (8,)


def test_ids_out_of_range_or_hashed():
    table = Table(np.zeros((4, 1)), [np.array([1, 5, 12, 3])], np.zeros(4))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\), got min 1 max 12"):
        list(TableDataset(table, keys=["a"], num_embeddings_per_feature=[10]).batches(4))
    hashed = TableDataset(table, keys=["a"], num_embeddings_per_feature=[10], hash_ids=True)
    b = next(hashed.batches(4, shuffle=False))
    assert b.sparse_features.values()[:4].tolist() == [1, 5, 2, 3]
