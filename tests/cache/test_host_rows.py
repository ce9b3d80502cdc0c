"""``host_rows``: the logical rows a process's devices cache, from the state's layout,
with the other processes' devices simulated (lanes marked not local)."""

import jax
import numpy as np
import pytest
from cache_cases import CACHED, build, configs, logical_plan, optimizer

from jaxrec import cache as jc
from jaxrec import distributed as d
from jaxrec import optim
from jaxrec.cache import owned


def _as_process(monkeypatch, mine):
    """This process's devices: ``mine`` (device ids); the others act as another's."""
    real = owned.lanes

    def lanes(sharding, shape):
        got, chunk, spec = real(sharding, shape)
        return [x._replace(local=x.device.id in mine) for x in got], chunk, spec

    monkeypatch.setattr(owned, "lanes", lanes)  # where the shards' lanes are read


def _state(gens):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    opt = optimizer(optim.rowwise_adagrad(0.3))
    params = {t: jc.CacheParams(load_factor=0.6) for t in CACHED}
    slot_configs, slot_plan = jc.device_plan(configs(), logical_plan(gens, mesh, params))
    return opt, *build(opt, slot_configs, slot_plan, mesh)


def test_rows_of_this_process_shards(monkeypatch):
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    opt, g, s = _state({"big": d.row_wise(), "mean": d.table_wise(2), "small": d.table_wise(0)})
    big, mean = configs()[0], configs()[1]
    assert jc.host_rows(g, opt, s, big) == (0, 200)  # one process: every row
    _as_process(monkeypatch, {2, 3})
    assert jc.host_rows(g, opt, s, big) == (100, 200)  # shards 2 and 3 of 4 (50 rows each)
    assert jc.host_rows(g, opt, s, mean) == (0, 120)  # table-wise on rank 2
    _as_process(monkeypatch, {0, 1})
    assert jc.host_rows(g, opt, s, mean) == (0, 0)


def test_a_row_shard_across_processes_is_refused(monkeypatch):
    """Column pieces of one row shard on two processes would each write back only their
    own columns into their host copy: refused, naming the table and shards."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    gens = {"big": d.column_wise([1, 3]), "mean": d.row_wise([0, 3]), "small": d.table_wise(0)}
    opt, g, s = _state(gens)
    assert jc.host_rows(g, opt, s, configs()[0]) == (0, 200)
    _as_process(monkeypatch, {0, 1})
    with pytest.raises(ValueError, match=r"big'.*row shards \[0\].*one process"):
        jc.host_rows(g, opt, s, configs()[0])


def test_host_rows_drawn_with_the_device_build_s_values(monkeypatch):
    """With its collection's key (``init_keys``) and its index as stream, a host table's
    rows (any range, chunked on the host) equal the device-built table's."""
    from flax import nnx

    import jaxrec as jr

    tables = [
        jr.EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=40),
        jr.EmbeddingBagConfig(
            name="b",
            embedding_dim=6,
            num_embeddings=3000,
            weight_init_min=-0.5,
            weight_init_max=0.25,
        ),
    ]

    class M(nnx.Module):
        def __init__(self):
            self.ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(5))

    want = np.asarray(M().ebc.state_dict()["embedding_bags.b.weight"])
    monkeypatch.setattr(jc.host, "INIT_CHUNK_ROWS", 700)  # several chunks, one cut mid-range
    key = d.init_keys(M)["ebc"]
    opt = optim.rowwise_adagrad(0.1)
    whole = jc.HostTable.create(tables[1], opt, key=key, stream=1)
    np.testing.assert_array_equal(whole.fields["weight"], want)
    part = jc.HostTable.create(tables[1], opt, rows=(1000, 2900), key=key, stream=1)
    np.testing.assert_array_equal(part.fields["weight"], want[1000:2900])
    other = jc.HostTable.create(tables[1], opt, key=key, stream=0)
    assert not np.array_equal(other.fields["weight"], want)
