"""A dynamic table's index step compiles deviceless for an H100 (the XLA program a GPU
runs) and works in place: its memory is the index plus the batch's ids, never a copy of
the index (issue 49). See zch_cases.py; ``pytest -s`` prints the figures."""

import pytest
import zch_cases
from compile_runner import assert_compiled, case_id, require_deviceless, run_cases


@pytest.fixture(scope="module")
def results():
    require_deviceless()
    got = run_cases(zch_cases.CASES)
    for name, r in got.items():  # shown with -s
        print(
            f"\n{name}: {'ok' if r.ok else r.error} in {r.seconds or 0:.1f} s, "
            f"memory {r.memory}, facts {r.facts}"
        )
    return got


@pytest.mark.parametrize("case", zch_cases.CASES, ids=case_id)
def test_index_step_compiles_in_place(results, case):
    result = results[case.name]
    assert_compiled(result, case)
    m, f = result.memory, result.facts
    # Donated: the state's arguments are its outputs (aliased), so the program holds
    # one index, not two (a copy of it would pass the bound by 160 MB); the rest is the
    # batch's: per id a [ways, ways] order (bools) and [ways] rows of keys and stamps.
    # Measured: 25 MB (LRU) and 37 MB (LFU + sketch) above the state, of 84 MB allowed.
    assert m["alias"] >= f["state_bytes"], (m, f)
    peak = m["argument"] + m["output"] - m["alias"] + m["temp"]
    per_id = f["ways"] * f["ways"] + 16 * f["ways"]
    assert peak <= f["state_bytes"] + f["ids"] * per_id, (m, f)
