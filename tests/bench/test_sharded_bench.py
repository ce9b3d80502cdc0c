"""bench/sharded.py at a tiny size: runs, and its layout-predicted bytes equal the HLO's."""

import json

import sharded


def test_tiny_run_predicts_the_compiled_collectives(capsys):
    argv = [
        "--E",
        "200",
        "--B",
        "8",
        "--T",
        "3",
        "--reps",
        "1",
        "--no-unsharded",
        "--types",
        "row_wise,column_wise,data_parallel",
    ]
    assert sharded.main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["impl"] for x in lines] == ["row_wise", "column_wise", "data_parallel"]
    for x in lines:
        assert x["comm_plan"]["kinds"] == x["comm_hlo"]["kinds"], x["impl"]
        assert x["median_ms"] > 0 and x["world"] == 8
    # column shards of a table send their peer one float32 per id it may receive (the
    # world's N x B x L ids of its feature), never one per table row
    assert lines[1]["comm_plan"]["stages"]["row_sum_permute"] == 4 * 8 * 8 * 10


# Lines of the step compiled deviceless for 8 H100s (trimmed after the attributes that
# matter): XLA:GPU prints async collectives without operand shapes; the operands are the
# first tuple of a *-start's result; *-done ops move nothing new.
GPU_HLO = """
  %all-to-all-start.3 = ((s32[8,160]{1,0}), s32[8,160]{1,0}) all-to-all-start(%fusion.1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %all-to-all-done.3 = s32[8,160]{1,0} all-to-all-done(%all-to-all-start.3)
  %all-gather-start = ((f32[5120,128]{1,0}, pred[5120]{0}, s32[5120]{0}), (f32[40960,128]{1,0}, pred[40960]{0}, s32[40960]{0})) all-gather-start(%bitcast.253.0, %gte.828, %gte.827), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %all-gather-start.1 = (f32[6,2]{1,0}, f32[48,2]{1,0}) all-gather-start(%param.3), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %all-gather-done = (f32[40960,128]{1,0}, pred[40960]{0}, s32[40960]{0}) all-gather-done(%all-gather-start)
  %all-reduce-start.1 = f32[38530]{0} all-reduce-start(%wrapped_concatenate), channel_id=13, replica_groups=mesh['axis_0'=8] {'axis_0'}, use_global_device_ids=true
  %all-reduce-start.2 = f32[12]{0} all-reduce-start(%x), channel_id=14, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true
  %all-reduce-done.1 = f32[38530]{0} all-reduce-done(%all-reduce-start.1)
"""  # noqa: E501


def test_gpu_hlo_async_collectives_are_parsed():
    ops = sharded.hlo_collectives(GPU_HLO)
    assert ops == [
        {"op": "all-to-all", "bytes": 8 * 160 * 4, "group": 8},
        {"op": "all-gather", "bytes": 5120 * 128 * 4 + 5120 + 5120 * 4, "group": 8},
        {"op": "all-gather", "bytes": 6 * 2 * 4, "group": 8},
        {"op": "all-reduce", "bytes": 38530 * 4, "group": 8},
        {"op": "all-reduce", "bytes": 12 * 4, "group": 4},
    ]


def test_gpu_compiled_collectives_match_their_operands():
    """A shard_map with known operands, compiled deviceless for 8 H100s (about a second)."""
    import jax
    import jax.numpy as jnp
    import pytest
    from jax.sharding import PartitionSpec as P

    from jaxrec import deviceless

    if deviceless.unavailable_reason():
        pytest.skip(deviceless.unavailable_reason())
    mesh = deviceless.mesh(deviceless.topology("1x1x8"), ("x",))

    def local(a, g):
        sent = jax.lax.all_to_all(a, "x", 0, 0, tiled=True)  # [8, 100] f32 per device
        gathered = jax.lax.all_gather(g, "x", tiled=True)  # [6] s32 per device
        return sent * 2, gathered, jax.lax.psum(jnp.sum(a), "x")

    fn = jax.shard_map(
        local, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P(), P()), check_vma=False
    )
    a = deviceless.abstract((64, 100), jnp.float32, mesh, P("x"))
    g = deviceless.abstract((48,), jnp.int32, mesh, P("x"))
    text = jax.jit(fn).trace(a, g).lower().compile().as_text()
    kinds = sharded.summarize(sharded.hlo_collectives(text))["kinds"]
    assert kinds == {"all-to-all": 8 * 100 * 4, "all-gather": 6 * 4, "all-reduce": 4}
