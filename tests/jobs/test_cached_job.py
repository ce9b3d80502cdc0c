"""``jaxrec-train-dlrm`` with tables in host memory and a device cache of their rows.

A cached table's rows live on the host and move to the device as batches need them,
so a run's results cannot depend on how many rows the device holds: a cache of 30% of
the rows (evicting and writing back all along, rows prefetched a batch ahead) must
train, evaluate and checkpoint exactly as a cache of every row (which never evicts),
and resume exactly. The reference is the all-device run: a cached run draws its host
tables with the all-device model's initial values, so it ends as the all-device run
does, from the start or resumed from an all-device checkpoint. The cache's own
exactness is also tested in tests/cache.
"""

import json
import shutil

import numpy as np
import pytest

from jaxrec.jobs.from_run import model_from_run
from jaxrec.jobs.train_dlrm import main

TINY = ["--num-train", "3072", "--num-eval", "1000", "--quiet"]
CACHED = ["--cache-tables", "t_cat_0,t_cat_1,t_cat_2"]  # 1000, 583 and 1000 rows


def _run(run_dir, *flags):
    assert main([*TINY, "--run-dir", str(run_dir), *flags]) == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads((run_dir / "summary.json").read_text()), [json.loads(x) for x in lines]


def _tables(run_dir):
    """The checkpoint's tables, restored into the model with every table on the device."""
    model, _ = model_from_run(run_dir)
    ebc = model.sparse_arch.embedding_bag_collection
    return {k: np.asarray(v) for k, v in ebc.state_dict().items()}


@pytest.mark.parametrize(
    "flags",
    [
        ["--batch-size", "128"],  # one device: the model unsharded
        ["--batch-size", "64", "--devices", "2", "--sharding", "row_wise"],
    ],
    ids=["unsharded", "row_wise"],
)
def test_cache_size_changes_nothing(tmp_path, flags):
    flags = [*flags, *CACHED, "--eval-every", "10", "--checkpoint-every", "16"]
    whole, whole_evals = _run(tmp_path / "whole", *flags, "--cache-load-factor", "1")
    small, small_evals = _run(tmp_path / "small", *flags, "--cache-load-factor", "0.3")
    assert [e["step"] for e in small_evals] == [10, 20, 24]
    assert small_evals == whole_evals  # every evaluation, bit for bit
    got, want = _tables(tmp_path / "small"), _tables(tmp_path / "whole")
    assert sorted(got) == sorted(want) and len(got) == 26
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # the smaller cache evicted: fewer slots, a lower hit rate
    assert set(small["cached_tables"]) == {"t_cat_0", "t_cat_1", "t_cat_2"}
    for name, rows in (("t_cat_0", 1000), ("t_cat_1", 583), ("t_cat_2", 1000)):
        w, s = whole["cached_tables"][name], small["cached_tables"][name]
        assert w["rows"] == s["rows"] == rows, name
        assert w["slots"] >= rows and s["slots"] <= 0.3 * rows + 2, name
        assert s["hit_rate"] < w["hit_rate"], name


def test_cached_run_resumes_exactly(tmp_path):
    """Cut at step 30, resumed with the cache, and resumed with every table on the
    device (the checkpoint holds the logical tables): both end as the whole run."""
    common = ["--batch-size", "128", "--epochs", "2"]
    flags = [*common, *CACHED, "--cache-load-factor", "0.3"]
    whole, _ = _run(tmp_path / "whole", *flags, "--no-checkpoint")
    part, _ = _run(tmp_path / "cut", *flags, "--max-steps", "30", "--checkpoint-every", "10")
    assert part["steps"] == 30
    shutil.copytree(tmp_path / "cut", tmp_path / "moved")
    resumed, _ = _run(tmp_path / "cut", *flags, "--resume")
    assert resumed["steps"] == whole["steps"] == 48
    assert resumed["eval"] == whole["eval"]
    on_device, _ = _run(tmp_path / "moved", *common, "--resume")
    assert "cached_tables" not in on_device and on_device["steps"] == 48
    assert on_device["eval"] == whole["eval"]


def test_cached_training_equals_all_device_training(tmp_path):
    """The reference: a run with three tables cached at 30% (host tables drawn with
    the all-device model's values) trains and evaluates bit for bit as the all-device
    run; so does an all-device run cut at step 30 and resumed with those tables cached
    (their rows restored into host tables, the caches empty)."""
    common = ["--batch-size", "128", "--epochs", "2"]
    whole, _ = _run(tmp_path / "whole", *common, "--no-checkpoint")
    fresh, _ = _run(
        tmp_path / "fresh", *common, *CACHED, "--cache-load-factor", "0.3", "--no-checkpoint"
    )
    assert sorted(fresh["cached_tables"]) == ["t_cat_0", "t_cat_1", "t_cat_2"]
    assert fresh["steps"] == 48 and fresh["eval"] == whole["eval"]
    _run(tmp_path / "cut", *common, "--max-steps", "30", "--checkpoint-every", "10")
    cached, _ = _run(tmp_path / "cut", *common, *CACHED, "--cache-load-factor", "0.3", "--resume")
    assert sorted(cached["cached_tables"]) == ["t_cat_0", "t_cat_1", "t_cat_2"]
    assert all(c["hit_rate"] < 1 for c in cached["cached_tables"].values())
    assert "cached_tables" not in whole and cached["steps"] == whole["steps"] == 48
    assert cached["eval"] == whole["eval"]


@pytest.mark.parametrize("devices", [1, 2])
def test_planner_caches_the_tables_that_do_not_fit(tmp_path, devices):
    """1.2-1.3 MiB of device memory a device: the planner keeps some tables in host memory
    (one device: it plans for one, and the model runs unsharded). On two devices it
    prices the caches with miss rates measured on the first 8 steps, and the summary
    shows what it expected beside what the caches did; there it also gives the memory
    its plan leaves free to some caches (``--cache-scale-up``)."""
    # With one host a cache's slot maps and its plan's temporaries are on the device
    # too (172 bytes per id received, with the 2 x 68 of the rows staged): for these
    # small tables a cache then saves little or nothing, and 0.001 GiB (as before) fits
    # no plan. One device needs ~1.07 MiB with some tables cached; on two, every table
    # fits uncached from ~1.04 MiB usable, so their memory sits just above the ~1023 KiB
    # of the plan that caches some.
    hbm = {1: "0.0013", 2: "0.00116"}[devices]
    flags = ["--batch-size", "64", "--devices", str(devices), "--hbm-gib", hbm]
    measured = devices == 2
    flags += ["--cache-statistics-batches", "8", "--cache-scale-up"] if measured else []
    summary, _ = _run(tmp_path / "run", *flags)
    cached = summary["cached_tables"]
    assert 0 < len(cached) < 26, cached
    share = {name: c["slots"] / c["rows"] for name, c in cached.items()}
    if measured:  # load factor 0.2 (the default) or more
        assert min(share.values()) > 0.19 and max(share.values()) > 0.21, share
    else:
        assert max(share.values()) < 0.21, share
    for name, c in cached.items():
        assert 0 < c["hit_rate"] < 1, (name, c)
        assert ("planned_hit_rate" in c) == measured, (name, c)
        if measured:  # 8 cold steps against 24 steps and 3 evaluations: near, not equal
            assert abs(c["planned_hit_rate"] - c["hit_rate"]) < 0.15, (name, c)
    assert summary["steps"] == 3072 // (64 * devices) and 0 <= summary["eval"]["auc"] <= 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--hbm-gib", "1", "--sharding", "row_wise"], "use --sharding planner"),
        (["--cache-tables", "t_cat_0", "--sharding", "data_parallel"], "cannot be cached"),
        (["--cache-tables", "t_cat_0", "--cache-load-factor", "0"], "must be in (0, 1]"),
        (["--cache-tables", "t_cat_0,t_nope"], "no table ['t_nope']"),
        (["--cache-tables", ","], "',' names no table"),
        (["--cache-statistics-batches", "-1"], "must be 0 or more"),
        (["--cache-statistics-batches", "4", "--sharding", "row_wise"], "use --sharding planner"),
        (["--cache-statistics-batches", "4"], "one device plans only with --hbm-gib"),
        (["--cache-scale-up", "--sharding", "table_wise"], "use --sharding planner"),
        (["--cache-tables", "t_cat_8", "--cache-load-factor", "0.1"], "--cache-load-factor"),
    ],
)
def test_bad_cache_flags_are_one_line(tmp_path, flags, message):
    with pytest.raises(SystemExit) as e:
        main([*TINY, "--run-dir", str(tmp_path / "run"), *flags])
    assert message in str(e.value) and "\n" not in str(e.value)
