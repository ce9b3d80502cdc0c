"""bench/scale.py on a tiny configuration, and bench/torchrec_comm.py against bench/sharded.py."""

import json

import pytest
import scale
import sharded
import torchrec_comm
from specs import LookupSpec

from jaxrec import distributed as d

REQUIRED = {
    "bench",
    "date",
    "cpu",
    "world",
    "local",
    "hbm_bytes",
    "batch_per_device",
    "fraction",
    "tables",
    "fits",
    "planning_s",
    "padded_bytes_per_device",
    "mean_unpadded_bytes_per_device",
    "padded_over_mean_unpadded",
    "tables_bytes",
    "state_bytes",
    "buffers_bytes",
    "id_buffer_bytes",
    "groups",
    "sharding_types",
    "jaxrec_comm",
    "torchrec_comm",
    "jaxrec_over_torchrec_operand",
    "jaxrec_over_torchrec_wire",
}


def test_tiny_scale_run(capsys, tmp_path):
    out = tmp_path / "scale.jsonl"
    argv = [
        "--tables",
        "40",
        "--topologies",
        "8x4",
        "--fractions",
        "0.3,0.5",
        "--hbm-gb",
        "2",
        "--batch",
        "64",
        "--out",
        str(out),
    ]
    assert scale.main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [json.loads(x) for x in out.read_text().splitlines()] == lines
    assert [r["fraction"] for r in lines] == [0.3, 0.5]
    for r in lines:
        assert set(r) >= REQUIRED, REQUIRED - set(r)
        assert r["fits"] and r["error"] is None
        target = r["fraction"] * 8 * 2 * 10**9
        assert r["tables_and_state_bytes"] == pytest.approx(target, rel=1e-3)
        assert r["tables_bytes"] + r["state_bytes"] + r["buffers_bytes"] == pytest.approx(
            r["padded_bytes_per_device"], rel=1e-9
        )
        assert sum(r["buffer_parts"].values()) == pytest.approx(r["buffers_bytes"], rel=1e-9)
        assert 1.0 <= r["padded_over_mean_unpadded"] < 1.5
        assert sum(r["sharding_types"].values()) == 40
        assert r["jaxrec_comm"]["operand"] > 0 and r["torchrec_comm"]["operand"] > 0
        assert all(g["expected_ids"] <= g["capacity"] <= g["natural_ids"] for g in r["groups"])


def test_table_set_is_seeded_and_scaled():
    topo = scale.Topology(world_size=64, local_world_size=8, hbm_cap=80 * 10**9)
    a, cons, _ = scale.table_set(0.5, topo)
    b, _, _ = scale.table_set(0.5, topo)
    assert [t.num_embeddings for t in a] == [t.num_embeddings for t in b]
    assert len(a) == 500 and len({t.embedding_dim for t in a}) == 5
    assert all(t.num_embeddings == a[0].num_embeddings for t in a[:5])  # the 1e9-row five
    assert 0.2 < sum(t.data_type.value == "FP16" for t in a) / 500 < 0.4
    pf = [c.pooling_factors[0] for c in cons.values()]
    assert min(pf) >= 1 and max(pf) <= 80


@pytest.mark.parametrize(
    "kind",
    [
        "table_wise",
        "row_wise",
        "column_wise",
        "data_parallel",
        "table_row_wise",
        "table_column_wise",
        "grid_shard",
    ],
)
def test_torchrec_scheme_equals_the_uniform_plans_of_bench_sharded(kind):
    """Per table, for any plan: summed over bench/sharded.py's uniform plans it gives the
    same operand and wire bytes as that script's per-type formulas."""
    spec = LookupSpec(T=8, E=100_000, D=64, B=512, L=10)
    gens, hosts = sharded.generators(kind, spec.T)
    ebc_like = type(
        "M",
        (),
        {
            "table_configs": [
                scale.EmbeddingBagConfig(
                    name=f"t{t}",
                    num_embeddings=spec.E,
                    embedding_dim=spec.D,
                    feature_names=[f"f{t}"],
                )
                for t in range(spec.T)
            ]
        },
    )
    plan = d.construct_module_sharding_plan(
        ebc_like, gens, world_size=sharded.WORLD, local_size=sharded.WORLD // hosts
    )
    inputs = dict.fromkeys(
        plan,
        torchrec_comm.TableInputs(
            rows=spec.E, dim=spec.D, itemsize=4, features=1, ids=spec.B * spec.L, bags=spec.B
        ),
    )
    local = sharded.WORLD // hosts if hosts > 1 else sharded.WORLD
    got = torchrec_comm.summarize(
        torchrec_comm.plan_parts(plan, inputs, world=sharded.WORLD, local=local, batch=spec.B)
    )
    want = sharded.torchrec_bytes(kind, spec)
    assert got["operand"] == want["operand"]
    assert got["wire"] == pytest.approx(want["wire"], abs=2)
