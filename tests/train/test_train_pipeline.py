"""TrainPipeline: same results as a plain loop, every batch trained, errors surfaced."""

import threading
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from train_models import BagModel, mse, random_batch

from jaxrec import optim
from jaxrec.embedding import CombinedOptimizer
from jaxrec.train import TrainPipeline, init_train_state, make_train_step


def _setup():
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    graphdef, state = init_train_state(BagModel(weighted=True, rngs=nnx.Rngs(0)), opt)
    return state, make_train_step(graphdef, opt, mse)


def _host_batches(n, seed=0):
    """Host-side batches (numpy leaves), as a data loader yields them."""
    rng = np.random.default_rng(seed)
    return [jax.tree.map(np.asarray, random_batch(rng, weighted=True)) for _ in range(n)]


def _run(pipeline, it):
    losses = []
    while True:
        try:
            loss, _ = pipeline.progress(it)
        except StopIteration:
            return losses
        losses.append(float(loss))


def test_pipeline_equals_plain_loop_over_two_epochs():
    data = _host_batches(5)
    state, step = _setup()
    want = []
    for _ in range(2):
        for b in data:
            state, loss, _ = step(state, jax.device_put(b))
            want.append(float(loss))
    p_state, p_step = _setup()
    pipeline = TrainPipeline(p_step, p_state, depth=2)
    got = _run(pipeline, iter(data)) + _run(pipeline, iter(data))  # a new iterator per epoch
    np.testing.assert_array_equal(got, want)
    for a, b in zip(jax.tree.leaves(pipeline.state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_batches_are_prepared_ahead_of_the_running_step():
    data, pulled = _host_batches(6), []

    def loader():
        for i, b in enumerate(data):
            pulled.append(i)
            yield b

    state, step = _setup()
    pipeline = TrainPipeline(step, state, depth=3)
    it = loader()
    pipeline.progress(it)  # trains batch 0; the thread keeps pulling without being asked
    deadline = time.monotonic() + 30
    while len(pulled) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pulled) >= 4  # batch 0 trained, 1..3 queued (depth 3)
    assert len(_run(pipeline, it)) == 5
    pipeline.close()


def test_loader_errors_and_misuse_are_reported():
    data = _host_batches(2)

    def broken():
        yield data[0]
        raise OSError("disk went away")

    state, step = _setup()
    pipeline = TrainPipeline(step, state)
    it = broken()
    pipeline.progress(it)
    with pytest.raises(OSError, match="disk went away"):
        pipeline.progress(it)
    it = iter(data)
    pipeline.progress(it)
    with pytest.raises(ValueError, match="before the current one was exhausted"):
        pipeline.progress(iter(data))
    pipeline.close()
    with pytest.raises(ValueError, match="depth"):
        TrainPipeline(step, state, depth=0)


def test_close_stops_the_producer_thread():
    state, step = _setup()
    pipeline = TrainPipeline(step, state, depth=1)
    before = threading.active_count()
    endless = iter(lambda: _host_batches(1)[0], None)
    pipeline.progress(endless)
    pipeline.close()
    deadline = time.monotonic() + 10
    while threading.active_count() >= before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before
