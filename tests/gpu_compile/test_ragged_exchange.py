"""The ragged id exchange compiles for 8 H100s (XLA:CPU has no ragged-all-to-all).

``exchange="ragged"`` moves only the ids each payload holds; XLA:CPU cannot run
the op, so it is checked here by compiling a sharded train step deviceless for
GPUs (about 10 s). Its results still need a GPU to check (``bench/gpu_check.sh``).
"""

import deviceless_step as ds
import pytest
import sharded as bench
from flax import nnx
from specs import LookupSpec

from jaxrec import deviceless
from jaxrec import distributed as d


@pytest.mark.parametrize("kind", ["row_wise"])
def test_ragged_exchange_compiles_for_h100s(kind):
    if deviceless.unavailable_reason():
        pytest.skip(deviceless.unavailable_reason())
    spec = LookupSpec(T=3, E=2000, D=16, B=64, L=4, weighted=True)
    gens, _ = bench.generators(kind, spec.T)
    mesh = ds.gpu_mesh("1x1x8")
    tables = bench.build_jaxrec(spec).table_configs
    shaped = nnx.eval_shape(lambda: bench.jr_ebc(tables, rngs=nnx.Rngs(0)))
    plan = d.ShardingPlan({"ebc": d.construct_module_sharding_plan(shaped, gens, world_size=8)})

    def build():
        ebc = bench.jr_ebc(tables, rngs=nnx.Rngs(0), is_weighted=True)
        return d.DistributedModelParallel(bench.Model(ebc), plan, mesh, exchange="ragged")

    batch = bench.local_batches(spec, 0)[0]
    compiled, _ = ds.compile_train_step(build, bench.optimizer(), bench.loss_fn, batch, mesh)
    text = compiled.as_text()
    # the id payloads: round 0 (forward and update merged by CSE) and the overflow
    # rounds of the forward and update loops; the pooled blocks and their gradients
    starts = text.count("ragged-all-to-all-start(")
    assert starts >= 5, starts
