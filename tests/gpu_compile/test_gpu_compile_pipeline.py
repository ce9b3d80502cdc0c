"""The pipelined train step on 8 H100s (deviceless): the next batch's id ``all_to_all`` is
asynchronous and runs beside the step's compute, and the step sends no ids of its own.

XLA:GPU makes every ``all-to-all`` asynchronous by default (``all-to-all-start`` /
``all-to-all-done``; ``--xla_gpu_disable_async_collectives=ALLTOALL`` would undo it) and
its latency-hiding scheduler, on by default, places compute between the two. No flag is
needed. See pipeline_cases.py for the model and what is measured.
"""

import pipeline_cases
import pytest
from compile_runner import assert_compiled, case_id, require_deviceless, run_cases

NAME = "sparse_dist_step_1x1x8"


@pytest.fixture(scope="module")
def results():
    require_deviceless()
    return run_cases(pipeline_cases.CASES)


@pytest.mark.parametrize("case", pipeline_cases.CASES, ids=case_id)
def test_sparse_dist_step_compiles(results, case):
    assert_compiled(results[case.name], case)


def _ahead(results):
    result = results[NAME]
    if not result.ok:
        pytest.fail(f"{NAME} did not compile: {result.error}")
    return result.facts["ahead"]


def test_next_batch_ids_all_to_all_runs_beside_compute(results):
    """One asynchronous all-to-all sends the next batch's ids, and the schedule puts
    kernels of this step (fusions, the Pallas sparse update) between its start and done."""
    ahead = _ahead(results)
    assert ahead["is_scheduled"], ahead
    assert ahead["starts"] == 1, ahead
    between = ahead["compute_between"]
    assert sum(between.values()) >= 5, ahead
    assert between.get("custom-call", 0) >= 1, ahead  # a kernel (Pallas update, GEMM)


def test_step_sends_no_ids_of_its_own(results):
    """The only int32 all-to-all in the program's top level is the next batch's: the
    step's lookups start from the ids that arrived with it (overflow rounds, rare, run
    inside loops and are not counted)."""
    assert _ahead(results)["int32_all_to_all_starts"] == 1, _ahead(results)
