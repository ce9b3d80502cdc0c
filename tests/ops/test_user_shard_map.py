"""Lookups inside a user's ``jax.shard_map`` with its default ``check_vma=True``.

jaxrec's sharded collections run their ``shard_map``s with ``check_vma=False``;
a user's own (data-parallel lookups over a batch axis) checks varying axes:
the bounds check's report and the Pallas kernels' output types must say how
they vary, in every platform branch, or tracing fails.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrec.ops import pooled_lookup, sequence_lookup

TRITON = "__gpu$xla.gpu.triton"


def _inputs():
    rng = np.random.default_rng(0)
    mesh = jax.make_mesh((2,), ("x",))
    table = jnp.asarray(rng.normal(size=(40, 8)), jnp.float32)
    lengths = np.tile([3, 0, 2, 1], 2).astype(np.int32)  # 4 bags per device
    values = rng.integers(0, 40, 12).astype(np.int32)  # 6 ids per device
    shard = NamedSharding(mesh, P("x"))
    return mesh, table, jax.device_put(values, shard), jax.device_put(lengths, shard)


def _per_device(fn, implementation, **kw):
    mesh, table, values, lengths = _inputs()

    def local(t, v, n):
        return fn(t, v, n, implementation=implementation, **kw)  # the bounds check is traced

    run = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x"), P("x")), out_specs=P("x"))
    return jax.jit(run), (table, values, lengths)


@pytest.mark.parametrize("fn", [pooled_lookup, sequence_lookup], ids=lambda f: f.__name__)
@pytest.mark.parametrize("implementation", [None, "xla", "cpu"])
def test_lookups_run_per_device_and_match_unsharded(fn, implementation):
    run, (table, values, lengths) = _per_device(fn, implementation)
    got = np.asarray(run(table, values, lengths))
    halves = [
        (np.asarray(values)[i * 6 : (i + 1) * 6], np.asarray(lengths)[i * 4 : (i + 1) * 4])
        for i in range(2)
    ]
    want = np.concatenate([np.asarray(fn(table, v, n, implementation="xla")) for v, n in halves])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_the_gpu_program_keeps_its_kernel():
    # (no bounds report: its host callback cannot be lowered for cuda on a CPU mesh)
    run, args = _per_device(pooled_lookup, None, bounds_check_mode="IGNORE")
    assert TRITON in run.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
