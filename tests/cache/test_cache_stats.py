"""Miss rates measured with the cache's own policy (``jaxrec.cache.measure_miss_rates``)
against an independent LRU and the uniform law, and what the planner does with them."""

from collections import OrderedDict

import numpy as np
import pytest
from cache_model import lru_hit_rate

import jaxrec as jr
from jaxrec.cache import measure_miss_rates
from jaxrec.datasets.random import zipf_ids
from jaxrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from jaxrec.distributed.types import EmbeddingComputeKernel, cache_slots

UVM = EmbeddingComputeKernel.FUSED_UVM_CACHING


def _lru_misses(stream, slots, first):
    """A plain LRU cache of ``slots`` rows over single-id batches: misses from ``first`` on."""
    cache, misses = OrderedDict(), 0
    for i, r in enumerate(stream):
        if r in cache:
            cache.move_to_end(r)
            continue
        misses += i >= first
        if len(cache) == slots:
            cache.popitem(last=False)
        cache[r] = True
    return misses


def test_lru_with_one_id_a_batch_is_plain_lru():
    rows, n = 5000, 6000
    stream = zipf_ids(np.random.default_rng(0), rows, n, 0.9)
    lfs = (0.01, 0.05, 0.2)
    batches = [stream[i : i + 1] for i in range(n)]
    curve = measure_miss_rates(batches, rows, lfs, "lru", steady=False)  # the cold run alone
    want = [_lru_misses(stream.tolist(), cache_slots(rows, lf), n // 2) / (n // 2) for lf in lfs]
    assert curve.load_factors == lfs
    np.testing.assert_allclose(curve.miss_rates, want, rtol=0, atol=1e-12)
    assert want[0] > want[-1] > 0  # the check can tell the load factors apart


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_uniform_ids_miss_as_the_uniform_law(algorithm):
    """Warm (many batches over a small table): a cache of ``lf`` of uniform rows misses
    ``1 - lf`` of the ids (minus the rows a batch repeats)."""
    rows, rng = 20_000, np.random.default_rng(1)
    batches = [rng.integers(0, rows, 200) for _ in range(600)]
    curve = measure_miss_rates(batches, rows, (0.05, 0.2, 0.5), algorithm)
    np.testing.assert_allclose(curve.miss_rates, [0.95, 0.8, 0.5], atol=0.02)


@pytest.mark.parametrize("alpha", [0.8, 1.05, 1.2])
def test_a_short_sample_is_near_the_steady_state_and_not_below_it(alpha):
    """100 batches of 2048 Zipf ids over 200k rows: a cache of more than ~15% of the rows
    does not fill, so the cold run floors at the sample's first lookups; with the steady
    estimate the curve keeps falling. The truth: Che's approximation on the law itself
    (``bench/cache_model.py``, checked there against a simulated LRU)."""
    rows, lfs = 200_000, (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
    rng = np.random.default_rng(3)
    batches = [zipf_ids(rng, rows, 2048, alpha) for _ in range(100)]
    truth = np.array([1 - lru_hit_rate(rows, cache_slots(rows, lf), alpha) for lf in lfs])
    cold = np.array(measure_miss_rates(batches, rows, lfs, steady=False).miss_rates)
    both = np.array(measure_miss_rates(batches, rows, lfs).miss_rates)
    assert np.all(both - truth < 0.06) and np.all(both - truth > -0.01), (both, truth)
    assert both[-1] < cold[-1] - 0.03  # the cold run alone stays far above at lf 0.5
    assert np.all(cold - truth > -0.01)  # (the cold run errs high too)


def test_a_cache_one_batch_overfills_misses_everything_and_bad_ids_are_refused():
    rows = 1000
    batches = [np.arange(300), np.arange(300, 600)]  # 300 distinct rows a batch
    curve = measure_miss_rates(batches, rows, (0.1, 0.5))  # 100 slots: cannot hold one batch
    assert curve.miss_rates[0] == 1.0 and curve.miss_rates[1] == 1.0  # cold: every row new
    with pytest.raises(ValueError, match=r"batches \[1\] hold ids outside \[0, 1000\)"):
        measure_miss_rates([np.arange(5), np.array([1000])], rows)
    with pytest.raises(ValueError, match=r"batches \[0\] hold ids outside"):  # not wrapped
        measure_miss_rates([np.array([2**32 + 5], np.int64)], rows)
    with pytest.raises(ValueError, match="at least one batch"):
        measure_miss_rates([], rows)


def test_the_planner_caches_the_table_measured_to_miss_less():
    """Two tables alike but for their ids; one fits the device. Priced as uniform ids,
    the tie goes to the first table (``uniform``); with the measured rates, the planner
    caches ``skewed``, whose misses cost less."""
    rows, batch = 2_000_000, 4096
    tables = [
        jr.EmbeddingBagConfig(name=n, num_embeddings=rows, embedding_dim=64)
        for n in ("uniform", "skewed")
    ]
    rng = np.random.default_rng(2)
    stats = {
        "uniform": measure_miss_rates([rng.integers(0, rows, batch) for _ in range(100)], rows),
        "skewed": measure_miss_rates([zipf_ids(rng, rows, batch, 1.05) for _ in range(100)], rows),
    }
    lf = 0.2
    assert (
        stats["skewed"].expected_miss_rate(lf, rows)
        < 0.5
        < stats["uniform"].expected_miss_rate(lf, rows)
    )

    def plan(cap, with_stats):
        cons = {
            t.name: ParameterConstraints(
                sharding_types=["table_wise"],
                cache_statistics=stats[t.name] if with_stats else None,
            )
            for t in tables
        }
        planner = EmbeddingShardingPlanner(
            Topology(world_size=1, batch_size=batch, hbm_cap=cap), cons
        )
        p = planner.plan(tables).plan[""]
        return sorted(n for n, ps in p.items() if ps.compute_kernel is UVM)

    table_bytes = rows * (64 * 4 + 4)  # weights and row-wise Adagrad's state
    cap = int(1.5 * table_bytes / 0.85)  # one table and a cache, not two tables
    assert plan(cap, False) == ["uniform"]
    assert plan(cap, True) == ["skewed"]
