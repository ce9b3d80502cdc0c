"""bench/backward_plan.py: the fused backward's plan on a preset, no kernel run."""

import backward_plan
from specs import LookupSpec


def test_plan_stats_bound_the_chain_and_count_the_old_one():
    spec = LookupSpec(T=2, E=5_000, D=16, B=512, L=20, alpha=1.2)
    new = backward_plan.plan_stats(spec, 32)
    old = backward_plan.plan_stats(spec, None)
    assert new["ids"] == old["ids"] == 2 * 512 * 20
    assert new["longest_chain"] <= 32 < new["hottest_row_ids"]
    assert old["longest_chain"] == old["hottest_row_ids"]
    assert len(new["launches"]) == new["reductions"] + 1 and len(old["launches"]) == 1


def test_main_prints_both_schedules(capsys):
    assert backward_plan.main(["--preset", "tiny"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and '"piece_len": null' in lines[1]
