"""Ids of every integer dtype are bounds-checked in their own width.

A uint32 id >= 2**31 used to wrap to a negative int32 inside the check, pass
it, and read (and train) a neighbouring table's row of the stacked buffer.
"""

import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxrec as jr
from jaxrec import cpu, optim
from jaxrec.embedding import CombinedOptimizer
from jaxrec.train import init_train_state, make_train_step

ROWS, DIM = 5, 4
KEYS = ["f0", "f1"]
IMPLS = ["xla", pytest.param("cpu", marks=pytest.mark.skipif(not cpu.available(), reason="no C++"))]
DTYPES = [np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32]


def bad_ids(dtype):
    """Out-of-range ids of ``dtype``: its extremes, the first id past the table, 2**31."""
    info = np.iinfo(dtype)
    ids = {int(info.max), ROWS, int(info.max) // 2 + 1}
    if info.min < 0:
        ids |= {-1, int(info.min)}
    return sorted(ids)


def batch(dtype):
    """f0: [1] [bad..]   f1: [bad.., 3] [4]; ``(values, lengths, bags)`` with Python bags."""
    bad = bad_ids(dtype)
    bags = [[[1], list(bad)], [[*bad, 3], [4]]]
    values = np.asarray([i for key in bags for bag in key for i in bag], dtype)
    lengths = np.asarray([len(bag) for key in bags for bag in key], np.int32)
    return values, lengths, bags


def make_ebc(impl, mode):
    tables = [
        jr.EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[k]
        )
        for i, k in enumerate(KEYS)
    ]
    return jr.EmbeddingBagCollection(
        tables, rngs=nnx.Rngs(0), bounds_check_mode=mode, implementation=impl
    )


def reference(ebc, bags):
    """``[B, 2 * D]``: in-range ids summed, every other id contributes zero."""
    sd = ebc.state_dict()
    out = np.zeros((2, 2 * DIM))
    for k, key_bags in enumerate(bags):
        w = np.asarray(sd[f"embedding_bags.t{k}.weight"], np.float64)
        for b, bag in enumerate(key_bags):
            for i in bag:
                if 0 <= i < ROWS:
                    out[b, k * DIM : (k + 1) * DIM] += w[i]
    return out


def kjt_of(values, lengths):
    return jr.KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths, capacities=[8, 8])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_drops_ids_of_every_dtype(impl, dtype, caplog):
    values, lengths, bags = batch(dtype)
    kjt = kjt_of(values, lengths)
    assert kjt.values().dtype == dtype
    ebc = make_ebc(impl, "WARNING")
    want = reference(ebc, bags)
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        got = jax.block_until_ready(jax.jit(lambda m, x: m(x).values())(ebc, kjt))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    n_bad = 2 * len(bad_ids(dtype))
    assert f"{n_bad} ids out of range" in caplog.text
    ebc.bounds_check_mode = jr.BoundsCheckMode.IGNORE
    np.testing.assert_allclose(ebc(kjt).values(), want, rtol=1e-6, atol=1e-6)
    ebc.bounds_check_mode = jr.BoundsCheckMode.FATAL
    with pytest.raises(Exception, match="ids out of range"):
        jax.block_until_ready(ebc(kjt).values())


def test_example_id_is_reported_in_its_own_width(caplog):
    values = np.asarray([1, 2**32 - 1, 3], np.uint32)
    kjt = jr.KeyedJaggedTensor(KEYS, values, lengths=[1, 0, 1, 1], capacities=[1, 2])
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        jax.block_until_ready(make_ebc("xla", "WARNING")(kjt).values())
    assert f"e.g. id {2**32 - 1}" in caplog.text


class Model(nnx.Module):
    def __init__(self, impl, mode):
        self.ebc = make_ebc(impl, mode)

    def __call__(self, kjt):
        return self.ebc(kjt).values()


def loss_fn(model, kjt):
    out = model(kjt)
    return jnp.sum(out * jnp.arange(1.0, out.size + 1).reshape(out.shape))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [np.uint32, np.int8, np.uint16])
def test_train_step_updates_only_rows_of_in_range_ids(impl, dtype):
    values, lengths, bags = batch(dtype)
    kjt = kjt_of(values, lengths)
    opt = CombinedOptimizer(optax.sgd(0.1), optim.sgd(0.1))
    for mode in ("IGNORE", "WARNING"):
        model = Model(impl, mode)
        before = np.asarray(model.ebc.weights["fp32_d4"].get_value())
        graphdef, state = init_train_state(model, opt)
        step = make_train_step(graphdef, opt, loss_fn, implementation=impl)
        state, _, _ = step(state, kjt)
        after = np.asarray(state.tables["ebc"]["weights"]["fp32_d4"].get_value())
        touched = {1, ROWS + 3, ROWS + 4}  # the in-range ids' stacked rows
        for r in range(2 * ROWS):
            if r in touched:
                assert not np.array_equal(after[r], before[r]), (mode, r)
            else:
                np.testing.assert_array_equal(after[r], before[r], err_msg=f"{mode} row {r}")


@pytest.mark.parametrize("impl", IMPLS)
def test_train_step_fatal_catches_wide_ids(impl):
    values = np.asarray([1, 2**31, 3], np.uint32)
    kjt = jr.KeyedJaggedTensor(KEYS, values, lengths=[1, 0, 1, 1], capacities=[1, 2])
    opt = CombinedOptimizer(optax.sgd(0.1), optim.sgd(0.1))
    graphdef, state = init_train_state(Model(impl, "FATAL"), opt)
    step = make_train_step(graphdef, opt, loss_fn, donate=False, implementation=impl)
    with pytest.raises(Exception, match="ids out of range"):
        jax.block_until_ready(step(state, kjt))


X64_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np
    from flax import nnx
    import jaxrec as jr
    from jaxrec import cpu
    assert jax.config.jax_enable_x64
    tables = [jr.EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=5,
                                    feature_names=[f"f{i}"]) for i in range(2)]
    impls = ["xla"] + (["cpu"] if cpu.available() else [])
    for dtype, bad in [(np.int64, [-1, 2**31, 2**32 + 3, 2**63 - 1, -2**63]),
                       (np.uint64, [2**31, 2**32 - 1, 2**32 + 3, 2**64 - 1])]:
        values = np.asarray([1, *bad, 3], dtype)
        lengths = np.asarray([1, 0, len(bad) + 1, 0], np.int32)
        kjt = jr.KeyedJaggedTensor(["f0", "f1"], values, lengths=lengths,
                                   capacities=[1, len(bad) + 1])
        for impl in impls:
            ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0), implementation=impl,
                                            bounds_check_mode="IGNORE")
            sd = ebc.state_dict()
            w0 = np.asarray(sd["embedding_bags.t0.weight"])
            w1 = np.asarray(sd["embedding_bags.t1.weight"])
            want = np.zeros((2, 8))
            want[0, :4], want[0, 4:] = w0[1], w1[3]
            got = np.asarray(ebc(kjt).values())
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    print("ok")
    """
)


def test_64_bit_ids_under_x64():
    """int64 / uint64 ids need JAX's x64 mode, which is process-wide: a subprocess."""
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    run = subprocess.run(
        [sys.executable, "-c", X64_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.skipif(not cpu.available(), reason="no C++ kernels")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_path_reads_narrow_ids_itself_and_gets_wide_ids_checked(dtype):
    """Ids that fit int32 go to the KJT kernel (a lossless cast); wider ones are checked
    by the XLA path in their own width and reach the C++ bag kernel as rows."""
    values, lengths, _ = batch(dtype)
    ebc = make_ebc("cpu", "IGNORE")
    text = jax.jit(lambda m, x: m(x).values()).lower(ebc, kjt_of(values, lengths)).as_text()
    fits = np.iinfo(dtype).max <= np.iinfo(np.int32).max
    assert ("jaxrec_kjt_embedding_bag" in text) == fits
    assert ("jaxrec_embedding_bag" in text) != fits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num", [0, 1, 5, 200, 2**31 - 1])
def test_ids_in_range_static_and_traced_bounds(dtype, num):
    from jaxrec.xla.bounds import ids_in_range

    info = np.iinfo(dtype)
    ids = np.unique(
        np.asarray(
            [
                info.min,
                info.min + 1,
                -1,
                0,
                1,
                4,
                5,
                127,
                199,
                200,
                info.max // 2 + 1,
                info.max - 1,
                info.max,
            ],
            np.int64,
        ).clip(info.min, info.max)
    ).astype(dtype)
    want = [0 <= int(i) < num for i in ids]
    assert np.asarray(ids_in_range(jnp.asarray(ids), num)).tolist() == want
    traced = jax.jit(ids_in_range)(jnp.asarray(ids), jnp.asarray(num, jnp.int32))
    assert np.asarray(traced).tolist() == want
