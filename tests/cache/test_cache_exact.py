"""A cached model trains exactly as the all-device-memory model (tables, optimizer
rows, dense params, losses), for several optimizers, policies and plans."""

import numpy as np
import pytest
from cache_cases import (
    CACHED,
    build,
    cached_twin,
    dense,
    local_batch,
    logical_tables,
    loss_fn,
    optimizer,
)

from jaxrec import cache as jc
from jaxrec import optim, train

STEPS = 12
OPTS = {
    "sgd": lambda: optim.sgd(0.3),
    "rowwise_adagrad": lambda: optim.rowwise_adagrad(0.3),
    "adam": lambda: optim.adam(0.05),
}


def run_pair(opt, params, steps=STEPS, seed=0):
    graphdef, state = build(opt)
    g2, s2, cache = cached_twin(opt, graphdef, state, params)
    step = train.make_train_step(graphdef, opt, loss_fn)
    cstep = jc.CachedTrainStep(train.make_train_step(g2, opt, loss_fn), cache)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        b = local_batch(rng)
        state, loss, _ = step(state, b)
        s2, loss2, _ = cstep(s2, b)
        np.testing.assert_array_equal(np.asarray(loss), np.asarray(loss2))
    s2 = cache.flush(s2)
    return (graphdef, state), (g2, s2), cache


@pytest.mark.parametrize("name", list(OPTS))
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_unsharded_exact(name, algorithm):
    opt = optimizer(OPTS[name]())
    params = {t: jc.CacheParams(algorithm=algorithm, load_factor=0.3) for t in CACHED}
    (g, s), (g2, s2), cache = run_pair(opt, params)
    want = logical_tables(g, opt, s)
    got = logical_tables(g2, opt, s2, cache)
    for t in want:
        for f in want[t]:
            np.testing.assert_array_equal(got[t][f], want[t][f], err_msg=f"{t}.{f}")
    for a, b in zip(dense(s), dense(s2), strict=True):
        np.testing.assert_array_equal(a, b)
    for t in CACHED:  # the cache was too small to hold everything: rows went both ways
        assert cache.stats[t].evictions > 0 and 0 < cache.stats[t].hit_rate < 1
