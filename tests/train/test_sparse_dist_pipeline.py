"""TrainPipelineSparseDist's protocol: priming, the ids handed from step to step, draining,
deferred loader errors. A recording fake step, nothing compiled (the sharded results are
checked in tests/distributed/test_pipeline_sparse_dist.py)."""

import jax
import jax.numpy as jnp
import pytest

from jaxrec.train import (
    SparseDistTrainStep,
    TrainPipeline,
    TrainPipelineSparseDist,
    make_train_step,
)
from jaxrec.train.guard import StepReport
from jaxrec.train.sparse_dist_step import _tainted


class FakeStep:
    """``input_dist(b) = ("ids", b)``; a step records ``(state, ids, batch, next)``."""

    def __init__(self):
        self.calls = []

    def input_dist(self, state, batch):
        return ("ids", batch)

    def jitted(self, state, ids, batch, next_batch):
        self.calls.append((state, ids, batch, next_batch))
        report = StepReport(None, None, {}, {}, {}, None)
        return state + 1, jnp.float32(batch), None, report, ("ids", next_batch)


def _pipeline(fake):
    step = SparseDistTrainStep(fake.jitted, fake.input_dist)
    return TrainPipelineSparseDist(step, 0, to_device=lambda b: b)


def _run(pipeline, it):
    out = []
    while True:
        try:
            out.append(int(pipeline.progress(it)[0]))
        except StopIteration:
            return out


def test_each_step_consumes_the_ids_the_previous_step_sent():
    fake = FakeStep()
    pipeline = _pipeline(fake)
    assert _run(pipeline, iter([10, 11, 12])) == [10, 11, 12]
    assert fake.calls == [
        (0, ("ids", 10), 10, 11),  # primed by input_dist
        (1, ("ids", 11), 11, 12),  # sent by the step before
        (2, ("ids", 12), 12, 12),  # drained: its own batch again, unused
    ]
    assert pipeline.state == 3
    assert _run(pipeline, iter([20])) == [20]  # a new epoch primes again
    assert fake.calls[-1] == (3, ("ids", 20), 20, 20)
    assert _run(pipeline, iter([])) == []


def test_loader_error_comes_after_the_batch_before_it_trained():
    def broken():
        yield 10
        yield 11
        raise OSError("disk went away")

    fake = FakeStep()
    pipeline = _pipeline(fake)
    it = broken()
    assert int(pipeline.progress(it)[0]) == 10
    assert int(pipeline.progress(it)[0]) == 11  # the error is found here, raised next
    with pytest.raises(OSError, match="disk went away"):
        pipeline.progress(it)
    assert [c[2] for c in fake.calls] == [10, 11]
    assert _run(pipeline, iter([12])) == [12]  # a new loader after the error
    with pytest.raises(ValueError, match="before the current one was exhausted"):
        pipeline.progress(iter([1, 2]))  # the first call runs; the second sees a new iterator
        pipeline.progress(iter([1, 2]))


def test_needs_a_sparse_dist_step():
    step = make_train_step(None, None, None)
    with pytest.raises(TypeError, match="make_sparse_dist_train_step"):
        TrainPipelineSparseDist(step, None)
    assert isinstance(TrainPipelineSparseDist(SparseDistTrainStep(None, None), 0), TrainPipeline)


def test_state_dependence_follows_calls_and_loops():
    """The check behind refusing state-dependent ids: a call's outputs are told apart,
    a loop's carry that takes the state on its second iteration is caught."""

    def f(state, batch):
        only_batch = jax.jit(lambda s, b: (s + 1, b * 2))(state, batch)[1]
        body = lambda c, _: ((c[1], state), None)
        (late, _), _ = jax.lax.scan(body, (batch, batch), None, length=2)
        return only_batch, late

    closed = jax.make_jaxpr(f)(1.0, 2.0)
    assert _tainted(closed.jaxpr, [True, False]) == [False, True]
    assert _tainted(closed.jaxpr, [False, True]) == [True, True]
