"""jaxrec's train step compiles deviceless for H100s, and XLA's GPU memory figures agree
with what jaxrec promises: no dense table gradient, and the planner's estimate.

One run compiles every case of ``step_cases`` in worker subprocesses (see
compile_runner.py); the tests read its results.
"""

import pytest
import step_cases
from compile_runner import assert_compiled, case_id, require_deviceless, run_cases

SHARDED = [c.name for c in step_cases.CASES if "unsharded" not in c.name]


@pytest.fixture(scope="module")
def results():
    require_deviceless()
    return run_cases(step_cases.CASES)


@pytest.mark.parametrize("case", step_cases.CASES, ids=case_id)
def test_train_step_compiles(results, case):
    assert_compiled(results[case.name], case)


@pytest.mark.parametrize("name", [c.name for c in step_cases.CASES])
def test_no_dense_table_gradient_on_gpu(results, name):
    """As tests/train/test_train_step.py asserts on CPU: temporaries scale with the batch,
    and the tables and their optimizer state are updated in place (aliased)."""
    result = results[name]
    if not result.ok:
        pytest.fail(f"{name} did not compile: {result.error}")
    mem = result.facts["memory"]
    # A dense gradient of the tables would need their size again (41 GB unsharded,
    # 8-31 GB per device sharded); the temporaries are the lookups' buffers.
    assert mem["temp"] < mem["embedding_args"] / 4, mem
    assert mem["alias"] >= mem["embedding_args"], mem


@pytest.mark.parametrize("name", SHARDED)
def test_planner_estimate_matches_the_gpu_compiler(results, name):
    """Tables + optimizer state: the planner's per-device bytes equal the compiler's
    arguments within 1%. In all (those + lookup buffers vs those + temporaries) the
    estimate is within 10% above the compiler's, never below it.

    Lookup buffers alone bound XLA's temporaries from above, by at most 1.6x
    (measured with the statistics-sized exchange: 1.06 for the planned Criteo
    tables, 1.07 for the host types on 2 x 4, 1.43 for the model holding every
    type; totals 1.006-1.040): the estimate sums every group's own peak, while
    XLA overlaps them in part (the data-parallel group's gathered copies and the
    column-split groups' updated rows or row-sum vectors come at other times),
    and the overflow path (extra rounds, update passes) reuses the fast path's
    memory. The estimate also counts CUB's radix-sort scratch (8 B per id),
    which these deviceless compiles lack (``xla_gpu_enable_cub_radix_sort`` off).
    """
    result = results[name]
    if not result.ok:
        pytest.fail(f"{name} did not compile: {result.error}")
    mem = result.facts["memory"]
    assert abs(mem["ratio_tables_state"] - 1) < 0.01, mem
    assert 1.0 <= mem["ratio_total"] <= 1.10, mem
    assert 1.0 <= mem["ratio_buffers_temp"] <= 1.6, mem


@pytest.mark.parametrize("name", [c.name for c in step_cases.CASES])
def test_gpu_programs_use_the_pallas_kernels_and_no_cpu_kernel(results, name):
    """The default (and forced "pallas") lookups and updates are Triton kernels in a GPU
    program, chosen for the lowering platform on this CPU host; no C++ FFI call leaks in."""
    result = results[name]
    if not result.ok:
        pytest.fail(f"{name} did not compile: {result.error}")
    kernels = result.facts["kernels"]
    assert kernels["cpu_ffi"] == 0, kernels
    assert kernels["triton"] >= 1, kernels


def test_ragged_exchange_compiles(results):
    """The 2 x 4 host-types case runs ``exchange="ragged"`` (XLA:CPU has no
    ragged-all-to-all): every id payload (round 0, merged by CSE for the forward and the
    update, and the overflow rounds of both loops) and the pooled blocks and their
    gradients travel by ``ragged_all_to_all``; its memory is checked above like the
    others' (the same buffers as the padded exchange). Its results need a GPU:
    ``tests/distributed/test_ragged_gpu.py``."""
    result = results["dlrm_sharded_1x2x4_host_types"]
    if not result.ok:
        pytest.fail(f"did not compile: {result.error}")
    got = result.facts["collectives"]
    assert got.get("ragged-all-to-all-start", 0) >= 5, got
    assert (
        "ragged-all-to-all-start"
        not in results["dlrm_sharded_1x1x8_every_type"].facts["collectives"]
    )
