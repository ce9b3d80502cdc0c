"""TrainPipeline never dispatches more than ``depth`` steps ahead of the device
(running far ahead can deadlock multi-device XLA:CPU programs: see
``jaxrec.train.in_flight``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrec.train import TrainPipeline
from jaxrec.train.in_flight import InFlight


@jax.jit
def _slow_step(state, batch):  # ~10-30 ms of matrix products: slower than dispatch
    m = jnp.full((256, 256), 1e-3, jnp.float32) + batch.sum()
    m = jax.lax.fori_loop(0, 60, lambda _, x: jnp.tanh(x @ x), m)
    return state + batch.sum(), m[0, 0]


@pytest.mark.parametrize("depth", [1, 2])
def test_pipeline_stays_within_depth_of_the_device(depth):
    losses, outstanding = [], []

    def step(state, batch):
        outstanding.append(sum(not x.is_ready() for x in losses))
        state, loss = _slow_step(state, batch)
        losses.append(loss)
        return state, loss, None

    batches = [np.full((4,), i, np.float32) for i in range(16)]
    pipeline = TrainPipeline(step, jnp.zeros(()), depth=depth)
    it = iter(batches)
    with pytest.raises(StopIteration):
        while True:
            pipeline.progress(it)
    assert float(pipeline.state) == sum(float(b.sum()) for b in batches)
    assert max(outstanding) <= depth, outstanding


def test_in_flight_waits_for_the_oldest_and_checks_its_limit():
    window = InFlight(2)
    xs = [jnp.ones(()) * i for i in range(5)]
    for x in xs:
        window.push(x)
    assert len(window._pending) == 2
    window.wait()
    assert not window._pending
    with pytest.raises(ValueError, match="limit must be at least 1"):
        InFlight(0)
