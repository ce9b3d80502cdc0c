"""A model larger than one H100 (105 GB of Criteo tables) builds sharded on 8 H100s with
each GPU drawing only its own shards: checked from the GPU compiler's memory figures
(see build_cases.py)."""

import build_cases
import pytest
from compile_runner import assert_compiled, case_id, require_deviceless, run_cases

GIB = 1024**3


@pytest.fixture(scope="module")
def results():
    require_deviceless()
    return run_cases(build_cases.CASES)


@pytest.mark.parametrize("case", build_cases.CASES, ids=case_id)
def test_build_programs_compile(results, case):
    assert_compiled(results[case.name], case)


def test_each_gpu_holds_its_shards_and_a_bounded_block(results):
    """Per device: a group program outputs exactly its block of shards, with
    temporaries of one block of rows (not a table: the largest is 20 GB); the dense
    program holds no table; the shards together are below one H100's memory while
    the model is above it."""
    facts = results["criteo_planned_build_8x80gb"].facts
    assert facts["table_bytes"] > 80 * GIB, facts
    for g in facts["groups"]:
        assert g["output"] == g["shard_bytes"], g
        assert g["temp"] < GIB, g
        assert g["args"] < 1024**2, g
    assert sum(g["output"] for g in facts["groups"]) < 80 * GIB, facts
    dense = facts["dense"]
    assert dense["temp"] + dense["output"] < facts["largest_table_bytes"] / 100, dense
