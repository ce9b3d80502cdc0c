"""Every Pallas kernel compiles deviceless for an H100 (Triton -> PTX -> ptxas, sm_90a).

One run compiles all cases in worker subprocesses (see compile_runner.py);
the tests then read its results, one test per case. The harness's own
failure cases run in the same batch, early, so the kernel cases also show
that an aborted or hung case takes nothing else down.
"""

import harness_cases
import kernel_cases
import pytest
from compile_runner import assert_compiled, case_id, require_deviceless, run_cases


@pytest.fixture(scope="module")
def results():
    require_deviceless()
    return run_cases(harness_cases.CASES + kernel_cases.CASES)


@pytest.mark.parametrize("case", kernel_cases.CASES, ids=case_id)
def test_kernel_compiles(results, case):
    assert_compiled(results[case.name], case)


MOSAIC = [c for c in kernel_cases.CASES if c.target == "kernel_cases:pooled_mosaic"]


@pytest.mark.parametrize("case", MOSAIC, ids=case_id)
def test_mosaic_launch(results, case):
    """The Mosaic GPU lookup's launch, read from its MLIR (its PTX needs a GPU): one
    warpgroup per program, bags along the grid's x, the shared memory its tiling sizes."""
    import jax

    from jaxrec.pallas.mosaic_pooled import ROWS, MosaicTiling, block_cols_for

    kw = case.kwargs
    tiling = MosaicTiling(**{k: v for k, v in kw.items() if k in MosaicTiling.__annotations__})
    table = jax.ShapeDtypeStruct((kernel_cases.ROWS, kw["dim"]), kw["dtype"])
    cols, size = block_cols_for(table, tiling), table.dtype.itemsize
    launch = results[case.name].facts["launch"]
    assert launch["block"] == [128, 1, 1]
    assert launch["grid"] == [kernel_cases.BAGS // tiling.block_bags, kw["dim"] // cols, 1]
    tiles = tiling.num_stages * ROWS * (cols * size + 16) + ROWS * cols * 4
    assert tiles <= launch["smem_bytes"] <= tiles + 1024  # + barriers and alignment


def test_shared_memory_over_the_limit_fails_compilation(results):
    assert_compiled(results[harness_cases.SHARED_MEMORY_OK.name], harness_cases.SHARED_MEMORY_OK)
    over = results[harness_cases.SHARED_MEMORY_OVER.name]
    assert not over.ok
    assert "RESOURCE_EXHAUSTED" in over.error and "Shared memory" in over.error


def test_spills_over_the_limit_fail(results):
    case = harness_cases.SPILLS
    result = results[case.name]
    assert result.ok, result.error  # it compiles; the spill check is what fails it
    assert result.spill_store_bytes > case.max_spill_bytes
    with pytest.raises(AssertionError, match="ptxas spilled"):
        assert_compiled(result, case)


def test_abort_fails_only_its_case(results):
    result = results[harness_cases.ABORT.name]
    assert not result.ok
    assert "SIGABRT" in result.error and harness_cases.ABORT_MESSAGE in result.error
    # the worker was replaced: more workers ran than the two started at first
    assert len({r.worker_pid for r in results.values()}) >= 3


def test_hang_times_out(results):
    result = results[harness_cases.HANG.name]
    assert not result.ok
    assert "timed out after 2 s" in result.error


def test_spill_limits_separate_jaxrec_kernels_from_xla_fusions():
    """jaxrec's kernels share the case's allowance; XLA's fusions only a blow-up bound."""
    from compile_runner import XLA_SPILL_LIMIT, Case, CaseResult

    case = Case(name="c", target="m:f")
    ok = CaseResult(name="c", error=None, spills=(("loop_fusion", XLA_SPILL_LIMIT, 0),))
    assert_compiled(ok, case)
    for spills in (
        (("jaxrec_pooled_lookup", 40, 0), ("jaxrec_sparse_update", 40, 0)),  # 80 > 64 together
        (("input_reduce_fusion", XLA_SPILL_LIMIT + 1, 0),),
    ):
        with pytest.raises(AssertionError, match="spilled"):
            assert_compiled(CaseResult(name="c", error=None, spills=spills), case)


def test_fused_backward_temporaries_at_the_target_size(results):
    """10.5M ids, D=128, compiled for an H100: the load-balanced fused backward's
    temporaries are its partial buffer (sized for the worst case: 676K rows, 346 MB)
    and the sort's per-id arrays (measured 37 bytes an id), a fraction of the
    ``[C, D]`` per-id gradients XLA's path materialises (5.4 GB)."""
    from jaxrec.pallas.runs import DEFAULT_PIECE_LEN, piece_layout

    ids, dim = kernel_cases.IDS, 128
    name = f"fused-rowwise_adagrad-float32-d{dim}-t8w4-ids{ids}"
    result = results[name]
    assert result.ok, result.error
    partial = piece_layout(ids, DEFAULT_PIECE_LEN).total * dim * 4
    temp = result.memory["temp"]
    assert partial <= temp <= partial + 48 * ids, (temp, partial)
    assert temp < ids * dim * 4 / 4
