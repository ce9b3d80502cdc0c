"""The KJT-direct C++ fused backward + update against the XLA path built from grad sources."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrec as jr
from jaxrec import cpu, optim
from jaxrec.xla.backward import backward_update_xla, pooled_grad_sources
from jaxrec.xla.slots import FeatureSlot

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"{cpu.unavailable_reason()}")

OPTIMIZERS = {
    "sgd": optim.sgd(0.1),
    "rowwise_adagrad_l2": optim.rowwise_adagrad(0.05, weight_decay=0.01, weight_decay_mode="L2"),
    "adagrad": optim.adagrad(0.1),
}
B, CAP = 7, 30
# Two slots share table t1 (rows [0, 40)); t2 (rows [40, 60)) is MEAN. Gradient
# columns are not contiguous: other groups' columns sit between them.
SLOTS = (
    FeatureSlot(key="a", row_offset=0, num_embeddings=40),
    FeatureSlot(key="b", row_offset=0, num_embeddings=40),
    FeatureSlot(key="c", row_offset=40, num_embeddings=20, pooling=jr.PoolingType.MEAN),
)


def _kjt(rng):
    lengths, values = [], []
    for n in (40, 40, 20):
        ls = rng.integers(0, 6, B)
        ls[0] = 0  # an empty bag
        lengths.append(ls)
        v = rng.integers(-3, n + 3, CAP)  # some ids out of range, on both sides
        v[1] = v[0]  # duplicates
        v[2:12] = n // 2  # a hot row: >= 8 ids (the kernel sums those during its scan)
        values.append(v)
    return jr.KeyedJaggedTensor(
        ["a", "b", "c"],
        np.concatenate(values).astype(np.int32),
        rng.random(3 * CAP).astype(np.float32),
        lengths=np.concatenate(lengths).astype(np.int32),
        capacities=[CAP] * 3,
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    ("dtype", "dim", "weighted"), [(jnp.float32, 12, True), (jnp.bfloat16, 7, False)]
)
def test_kjt_update_matches_xla(name, dtype, dim, weighted):
    opt = OPTIMIZERS[name]
    rng = np.random.default_rng(dim)
    kjt = _kjt(rng)
    cols = (3, 3 + dim + 5, 3 + 2 * dim + 9)
    g = jnp.asarray(rng.standard_normal((B, cols[-1] + dim + 2)), jnp.float32)
    table = jnp.asarray(rng.standard_normal((60, dim)), dtype)
    state = opt.init(60, dim)
    state = state._replace(**{f: getattr(state, f) + 0.25 for f in state._fields[1:]})

    def kernel(table, state):
        return cpu.kjt_backward_update_cpu(
            opt, table, state, g, kjt, SLOTS, cols, is_weighted=weighted, dep=0.0
        )

    def reference(table, state):
        flat = jnp.stack([g[:, c : c + dim] for c in cols], axis=1).reshape(B * len(cols), dim)
        rows, seg, scale, valid = pooled_grad_sources(kjt, SLOTS, is_weighted=weighted)
        return backward_update_xla(opt, table, state, flat, seg, scale, rows, valid)

    got = jax.jit(kernel)(table, state)
    want = jax.jit(reference)(table, state)
    for _ in range(2):  # more steps: the state is carried
        got, want = jax.jit(kernel)(*got), jax.jit(reference)(*want)
    tol = 2e-6 if dtype == jnp.float32 else 1e-2  # bf16: one rounding of a nearby value
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol
        )
    touched = np.zeros(60, bool)
    rows, _, _, valid = pooled_grad_sources(kjt, SLOTS)
    touched[np.asarray(rows)[np.asarray(valid)]] = True
    assert touched.sum() > 10 and (~touched).sum() > 5
    np.testing.assert_array_equal(np.asarray(got[0])[~touched], np.asarray(table)[~touched])


def test_kjt_update_declines_what_it_cannot_take():
    opt = optim.adam(0.1)
    kjt = _kjt(np.random.default_rng(0))
    with pytest.raises(NotImplementedError, match="no CPU kernel"):
        cpu.kjt_backward_update_cpu(
            opt,
            jnp.zeros((60, 4)),
            opt.init(60, 4),
            jnp.zeros((B, 12)),
            kjt,
            SLOTS,
            (0, 4, 8),
            is_weighted=False,
            dep=0.0,
        )
