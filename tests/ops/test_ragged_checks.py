"""Invalid ragged layouts on device: negative lengths and per-key capacity overflow.

Built directly (``KeyedJaggedTensor(...)`` from device arrays, under ``jit``),
so host validation never sees them. The rule on every path: a bag with a
negative length, or whose ids run past its key's capacity, contributes zero;
bag positions count non-negative lengths only. The bounds-check mode reports
them (WARNING logs the count and the first key, FATAL fails).
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxrec as jr
from jaxrec import cpu, optim
from jaxrec.embedding import CombinedOptimizer
from jaxrec.ops import FeatureSlot, grouped_pooled_lookup, grouped_sequence_lookup
from jaxrec.train import init_train_state, make_train_step

IMPLS = ["xla", pytest.param("cpu", marks=pytest.mark.skipif(not cpu.available(), reason="no C++"))]
KEYS, CAPS, B, ROWS = ["a", "b", "c"], [4, 6, 5], 3, 10
LAYOUTS = {
    # key-major lengths [F * B]
    "overflow": [2, 3, 1, 1, 0, 2, 5, 1, 0],  # a: 6 > 4 (bags 1, 2); c: 6 > 5 (bag 1)
    "negative": [2, -1, 1, 1, -2, 3, 0, 0, -7],  # bags with length < 0
    "both": [-1, 5, 1, 7, 0, 0, 1, 1, 1],  # a: bag 1 ends at 5 > 4; b: bag 0 at 7 > 6
    "valid": [1, 0, 3, 2, 2, 2, 0, 5, 0],
}
SLOTS = (
    FeatureSlot(key="a", row_offset=0, num_embeddings=ROWS),
    FeatureSlot(key="c", row_offset=ROWS, num_embeddings=ROWS, pooling=jr.PoolingType.MEAN),
    FeatureSlot(key="b", row_offset=ROWS, num_embeddings=ROWS),
)


def invalid_bags(lengths):
    """Plain-Python rule: ``{(key index, bag)}`` of bags that contribute zero, and each
    valid bag's ``(start, end)`` within its key's slice."""
    bad, ranges = set(), {}
    for k, cap in enumerate(CAPS):
        pos = 0
        for b in range(B):
            n = lengths[k * B + b]
            if n < 0:
                bad.add((k, b))
                continue
            if n and pos + n > cap:
                bad.add((k, b))
            else:
                ranges[(k, b)] = (pos, pos + n)
            pos += n
    return bad, ranges


def make_kjt(lengths, rng, weighted=False):
    values = rng.integers(0, ROWS, sum(CAPS)).astype(np.int32)
    w = rng.uniform(0.5, 2.0, sum(CAPS)).astype(np.float32) if weighted else None
    kjt = jr.KeyedJaggedTensor(
        KEYS,
        jnp.asarray(values),
        None if w is None else jnp.asarray(w),
        lengths=jnp.asarray(lengths, jnp.int32),
        capacities=CAPS,
    )
    return kjt, values, w


def pooled_reference(table, values, w, lengths, slots):
    _, ranges = invalid_bags(lengths)
    starts = np.concatenate([[0], np.cumsum(CAPS)])
    out = np.zeros((B, len(slots), table.shape[1]))
    for s, sl in enumerate(slots):
        k = KEYS.index(sl.key)
        for b in range(B):
            if (k, b) not in ranges:
                continue
            lo, hi = ranges[(k, b)]
            for c in range(starts[k] + lo, starts[k] + hi):
                out[b, s] += table[sl.row_offset + values[c]] * (1.0 if w is None else w[c])
            if sl.pooling == jr.PoolingType.MEAN and hi > lo:
                out[b, s] /= lengths[k * B + b]
    return out


def lookup(impl, mode, weighted):
    return jax.jit(
        lambda t, x: grouped_pooled_lookup(
            t, x, SLOTS, is_weighted=weighted, bounds_check_mode=mode, implementation=impl
        )
    )


@pytest.mark.parametrize("impl", [*IMPLS, "pallas"])  # pallas: the interpreter off GPU
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_lookup_matches_reference(impl, layout, weighted):
    rng = np.random.default_rng(len(layout))
    lengths = LAYOUTS[layout]
    kjt, values, w = make_kjt(lengths, rng, weighted)
    table = rng.standard_normal((2 * ROWS, 5)).astype(np.float32)
    want = pooled_reference(table.astype(np.float64), values, w, lengths, SLOTS)
    for mode in ("IGNORE", "NONE"):
        got = lookup(impl, mode, weighted)(jnp.asarray(table), kjt)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=mode)


@pytest.mark.parametrize("impl", IMPLS)
def test_reports_follow_bounds_check_mode(impl, caplog):
    rng = np.random.default_rng(0)
    kjt, _, _ = make_kjt(LAYOUTS["overflow"], rng)
    table = jnp.asarray(rng.standard_normal((2 * ROWS, 5)), jnp.float32)
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        jax.block_until_ready(lookup(impl, "WARNING", False)(table, kjt))
    assert caplog.text.count("have a negative length or run past") == 1
    assert "3 bags" in caplog.text and "first in key 'a'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        for mode in ("IGNORE", "NONE"):
            jax.block_until_ready(lookup(impl, mode, False)(table, kjt))
        ok, _, _ = make_kjt(LAYOUTS["valid"], rng)
        jax.block_until_ready(lookup(impl, "WARNING", False)(table, ok))
    assert caplog.text == ""
    with pytest.raises(Exception, match="run past their key's capacity"):
        jax.block_until_ready(lookup(impl, "FATAL", False)(table, kjt))
    neg, _, _ = make_kjt(LAYOUTS["negative"], rng)
    with pytest.raises(Exception, match="3 bags .* first in key 'a'"):
        jax.block_until_ready(lookup(impl, "FATAL", False)(table, neg))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_key_read_twice_is_reported_once(impl, caplog):
    rng = np.random.default_rng(5)
    lengths = LAYOUTS["overflow"]  # a: bags 1, 2 invalid; c: bag 1
    kjt, values, w = make_kjt(lengths, rng, weighted=True)
    w[[1, 2]] = np.nan  # key a: position 1 is in valid bag 0; position 2 is read by no bag
    kjt = jr.KeyedJaggedTensor(
        KEYS, jnp.asarray(values), jnp.asarray(w), lengths=kjt.lengths(), capacities=CAPS
    )
    slots = (SLOTS[0], FeatureSlot(key="a", row_offset=ROWS, num_embeddings=ROWS), SLOTS[1])
    table = jnp.asarray(rng.standard_normal((2 * ROWS, 4)), jnp.float32)
    f = jax.jit(
        lambda t, x: grouped_pooled_lookup(
            t, x, slots, is_weighted=True, bounds_check_mode="WARNING", implementation=impl
        )
    )
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        got = jax.block_until_ready(f(table, kjt))
    w[[1, 2]] = 0.0
    want = pooled_reference(np.asarray(table, np.float64), values, w, lengths, slots)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert "3 bags of" in caplog.text and "first in key 'a'" in caplog.text
    assert "1 per-sample weights of" in caplog.text


@pytest.mark.parametrize("impl", IMPLS)
def test_wide_lengths_stay_invalid(impl):
    # 2**31 + 1 as uint32 runs past the capacity; narrowed without care it would
    # wrap to a negative length, which leaves the later bag valid.
    kjt = jr.KeyedJaggedTensor(
        ["a"],
        jnp.arange(4, dtype=jnp.int32),
        lengths=jnp.asarray([1, 2**31 + 1, 1], jnp.uint32),
        capacities=[4],
    )
    table = jnp.arange(20.0).reshape(10, 2)
    slot = [FeatureSlot(key="a", row_offset=0, num_embeddings=10)]
    got = jax.jit(
        lambda t, x: grouped_pooled_lookup(
            t, x, slot, bounds_check_mode="IGNORE", implementation=impl
        )
    )(table, kjt)
    np.testing.assert_array_equal(got[:, 0], [[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])


def test_only_keys_the_lookup_reads_are_reported():
    rng = np.random.default_rng(1)
    kjt, _, _ = make_kjt(LAYOUTS["overflow"], rng)  # keys a and c overflow, b does not
    table = jnp.zeros((2 * ROWS, 2), jnp.float32)
    f = jax.jit(lambda t, x: grouped_pooled_lookup(t, x, SLOTS[2:], bounds_check_mode="FATAL"))
    jax.block_until_ready(f(table, kjt))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sequence_lookup_matches_reference(layout):
    rng = np.random.default_rng(2)
    lengths = LAYOUTS[layout]
    kjt, values, _ = make_kjt(lengths, rng)
    table = rng.standard_normal((2 * ROWS, 3)).astype(np.float32)
    got = jax.jit(lambda t, x: grouped_sequence_lookup(t, x, SLOTS, bounds_check_mode="IGNORE"))(
        jnp.asarray(table), kjt
    )
    _, ranges = invalid_bags(lengths)
    starts = np.concatenate([[0], np.cumsum(CAPS)])
    for s, sl in enumerate(SLOTS):
        k = KEYS.index(sl.key)
        want = np.zeros((CAPS[k], 3), np.float32)
        for (kk, _), (lo, hi) in ranges.items():
            if kk == k:
                for p in range(lo, hi):
                    want[p] = table[sl.row_offset + values[starts[k] + p]]
        np.testing.assert_array_equal(got[s], want)


def test_segment_ids_never_mix_keys():
    rng = np.random.default_rng(3)
    for lengths in LAYOUTS.values():
        kjt, _, _ = make_kjt(lengths, rng)
        seg = np.asarray(jax.jit(lambda x: x.segment_ids())(kjt))
        _, ranges = invalid_bags(lengths)
        want = np.full(sum(CAPS), len(KEYS) * B)
        starts = np.concatenate([[0], np.cumsum(CAPS)])
        for (k, b), (lo, hi) in ranges.items():
            want[starts[k] + lo : starts[k] + hi] = k * B + b
        np.testing.assert_array_equal(seg, want, err_msg=str(lengths))


def test_single_table_lookups_follow_the_rule():
    lengths = jnp.asarray([2, -1, 3, 2], jnp.int32)  # capacity 6: bag 3 ends at 7
    values = jnp.asarray([1, 2, 3, 4, 5, 6], jnp.int32)
    table = jnp.arange(20.0).reshape(10, 2)
    got = jax.jit(lambda t, v, n: jr.ops.pooled_lookup(t, v, n, bounds_check_mode="IGNORE"))(
        table, values, lengths
    )
    t = np.asarray(table)
    want = np.stack([t[1] + t[2], 0 * t[0], t[3] + t[4] + t[5], 0 * t[0]])
    np.testing.assert_array_equal(got, want)
    seq = jax.jit(lambda t, v, n: jr.ops.sequence_lookup(t, v, n, bounds_check_mode="IGNORE"))(
        table, values, lengths
    )
    np.testing.assert_array_equal(seq, np.concatenate([t[[1, 2, 3, 4, 5]], 0 * t[:1]]))
    jt = jr.JaggedTensor(values, lengths=lengths)
    np.testing.assert_array_equal(jt.segment_ids(), [0, 0, 2, 2, 2, 4])
    np.testing.assert_array_equal(jt.valid_mask(), [1, 1, 1, 1, 1, 0])


class Model(nnx.Module):
    def __init__(self, impl):
        tables = [
            jr.EmbeddingBagConfig(
                name=f"t{k}", embedding_dim=4, num_embeddings=ROWS, feature_names=[k]
            )
            for k in KEYS
        ]
        self.ebc = jr.EmbeddingBagCollection(
            tables, rngs=nnx.Rngs(0), bounds_check_mode="IGNORE", implementation=impl
        )

    def __call__(self, kjt):
        return self.ebc(kjt).values()


@pytest.mark.parametrize("impl", IMPLS)
def test_train_step_leaves_rows_of_invalid_bags_alone(impl):
    lengths = LAYOUTS["both"]
    values = np.zeros(sum(CAPS), np.int32)
    starts = np.concatenate([[0], np.cumsum(CAPS)])
    bad, ranges = invalid_bags(lengths)
    touched = set()
    for k in range(len(KEYS)):  # ids: each position its own row, so reads are traceable
        values[starts[k] : starts[k + 1]] = np.arange(CAPS[k])
        touched |= {k * ROWS + p for (kk, _), r in ranges.items() if kk == k for p in range(*r)}
    kjt = jr.KeyedJaggedTensor(
        KEYS, jnp.asarray(values), lengths=jnp.asarray(lengths, jnp.int32), capacities=CAPS
    )
    model = Model(impl)
    before = np.asarray(model.ebc.weights["fp32_d4"].get_value())
    opt = CombinedOptimizer(optax.sgd(0.1), optim.sgd(0.1))
    graphdef, state = init_train_state(model, opt)

    def loss_fn(m, x):
        out = m(x)
        return jnp.sum(out * jnp.arange(1.0, out.size + 1).reshape(out.shape))

    state, _, _ = make_train_step(graphdef, opt, loss_fn, implementation=impl)(state, kjt)
    after = np.asarray(state.tables["ebc"]["weights"]["fp32_d4"].get_value())
    assert bad and touched
    for r in range(len(KEYS) * ROWS):
        if r in touched:
            assert not np.array_equal(after[r], before[r]), r
        else:
            np.testing.assert_array_equal(after[r], before[r], err_msg=f"row {r}")


@pytest.mark.parametrize("impl", IMPLS)
def test_train_step_fatal_names_the_bad_lengths(impl):
    rng = np.random.default_rng(4)
    kjt, _, _ = make_kjt(LAYOUTS["negative"], rng)
    model = Model(impl)
    model.ebc.bounds_check_mode = jr.BoundsCheckMode.FATAL
    before = np.asarray(model.ebc.weights["fp32_d4"].get_value())
    opt = CombinedOptimizer(optax.sgd(0.1), optim.sgd(0.1))
    graphdef, state = init_train_state(model, opt)
    step = make_train_step(graphdef, opt, lambda m, x: jnp.sum(m(x)), implementation=impl)
    with pytest.raises(Exception, match="3 bags of pooled lookup .* first in key 'a'") as err:
        jax.block_until_ready(step(state, kjt))
    kept = getattr(err.value, "state", None)  # the train step's BoundsCheckError
    if kept is not None:
        after = kept.tables["ebc"]["weights"]["fp32_d4"].get_value()
        np.testing.assert_array_equal(after, before)
