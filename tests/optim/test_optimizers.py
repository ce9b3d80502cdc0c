"""jaxrec.optim: FBGEMM's row-wise updates against a float64 numpy oracle, plus a
contract suite over every optimizer and table dtype."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numpy_optimizers import STATE_LAYOUT, init_state
from numpy_optimizers import apply_rows as np_apply_rows

from jaxrec import optim

WDM = optim.WeightDecayMode
NUM_ROWS, DIM = 12, 5
FILL = NUM_ROWS  # a fill id: out of range, skipped
# Touched rows per step, padded with fill ids to a fixed U = 5 (one compile per optimizer).
# Rows 3 and 0/1/5/7/11 are touched in several steps; 2, 4, 6 and 9 never.
STEP_ROWS = [
    [0, 3, 5, 7, FILL],
    [3, 1, 8, FILL, FILL],
    [5, 3, 10, 11, FILL],
    [0, 1, 3, 11, 7],
]
NEVER_TOUCHED = [2, 4, 6, 9]
NAMES = list(STATE_LAYOUT)
FACTORIES = {name: getattr(optim, name) for name in NAMES}

# One jitted entry point: the optimizer is static, so every (optimizer, shape, dtype)
# compiles once and tests that share an optimizer object share its compile.
apply_rows = jax.jit(optim.apply_rows, static_argnums=0)

LR = 0.05
SCHEDULE = (0.1, 0.02, 3)  # optax.linear_schedule(init, end, transition_steps)
DEFAULTS = {name: FACTORIES[name](LR) for name in NAMES}


def _lr_schedule_np(t):
    """The linear schedule at training step ``t`` (1-based), computed independently."""
    init, end, steps = SCHEDULE
    return float(np.interp(t - 1, [0, steps], [init, end]))


def _data(seed=0):
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
    grads = [rng.normal(size=(len(r), DIM)).astype(np.float32) for r in STEP_ROWS]
    return table, grads


def _case(name, lr="const", **hp):
    label = "-".join([name, lr] + [f"{k}={getattr(v, 'value', v)}" for k, v in hp.items()])
    return pytest.param(name, lr, hp, id=label)


L2, DEC, NONE = WDM.L2, WDM.DECOUPLE, WDM.NONE
CASES = [
    _case("sgd"),
    _case("sgd", weight_decay=0.1, weight_decay_mode=L2),
    _case("sgd", weight_decay=0.1, weight_decay_mode=DEC),
    _case("sgd", "schedule"),
    _case("adagrad"),
    _case("adagrad", eps=1e-3),
    _case("adagrad", weight_decay=0.1, weight_decay_mode=L2),
    _case("adagrad", weight_decay=0.1, weight_decay_mode=DEC),
    _case("adagrad", "schedule"),
    _case("rowwise_adagrad"),
    _case("rowwise_adagrad", weight_decay=0.1, weight_decay_mode=NONE),
    _case("rowwise_adagrad", weight_decay=0.1, weight_decay_mode=L2),
    _case("rowwise_adagrad", weight_decay=0.1, weight_decay_mode=DEC),
    _case("rowwise_adagrad", "schedule", eps=1e-2, weight_decay=0.05, weight_decay_mode=L2),
    _case("adam"),
    _case("adam", b1=0.5, b2=0.9, eps=1e-4, weight_decay=0.01),
    _case("adam", "schedule", weight_decay=0.01),
    _case("partial_rowwise_adam"),
    _case("partial_rowwise_adam", b1=0.5, b2=0.9, eps=1e-4, weight_decay=0.01),
    _case("partial_rowwise_adam", "schedule"),
    _case("lamb"),
    _case("lamb", b1=0.5, b2=0.9, weight_decay=0.01),
    _case("lamb", "schedule", weight_decay=0.01),
    _case("partial_rowwise_lamb"),
    _case("partial_rowwise_lamb", b1=0.5, b2=0.9, weight_decay=0.01),
    _case("partial_rowwise_lamb", "schedule"),
    _case("lars_sgd"),
    _case("lars_sgd", eta=0.5, momentum=0.5, weight_decay=0.01),
    _case("lars_sgd", "schedule", eta=0.3),
]


@pytest.mark.parametrize("name, lr, hp", CASES)
def test_matches_numpy_reference(name, lr, hp):
    if lr == "const" and not hp:
        optimizer = DEFAULTS[name]  # shares its compile with the contract suite
    else:
        learning_rate = LR if lr == "const" else optax.linear_schedule(*SCHEDULE)
        optimizer = FACTORIES[name](learning_rate, **hp)
    np_hp = {k: getattr(v, "value", v) for k, v in hp.items()}
    table0, grads = _data()

    table, state = jnp.asarray(table0), optimizer.init(NUM_ROWS, DIM)
    ref_table, ref_state = table0.astype(np.float64), init_state(name, NUM_ROWS, DIM)
    for t, (rows, g) in enumerate(zip(STEP_ROWS, grads, strict=True), start=1):
        table, state = apply_rows(optimizer, table, state, jnp.asarray(rows), jnp.asarray(g))
        step_lr = LR if lr == "const" else _lr_schedule_np(t)
        ref_table, ref_state = np_apply_rows(
            name, ref_table, ref_state, rows, g, t, step_lr, **np_hp
        )

        np.testing.assert_allclose(table, ref_table, rtol=1e-5, atol=1e-5, err_msg=f"step {t}")
        assert set(optim.base.row_fields(state)) == set(ref_state)
        for field, ref in ref_state.items():
            np.testing.assert_allclose(
                getattr(state, field), ref, rtol=1e-5, atol=1e-7, err_msg=f"{field}, step {t}"
            )
        assert int(state.count) == t

    table = np.asarray(table)
    np.testing.assert_array_equal(table[NEVER_TOUCHED], table0[NEVER_TOUCHED])  # bit-identical
    for field in ref_state:
        assert not np.asarray(getattr(state, field))[NEVER_TOUCHED].any()


# ----- zero norms (LAMB / LARS): FBGEMM's behaviour where finite, guarded where it is NaN -----


def _one_step(optimizer, table, rows, grads, state=None):
    state = optimizer.init(NUM_ROWS, DIM) if state is None else state
    rows = jnp.asarray(rows + [FILL] * (5 - len(rows)))
    grads = jnp.asarray(np.pad(grads, ((0, 5 - len(grads)), (0, 0))), jnp.float32)
    return apply_rows(optimizer, jnp.asarray(table), state, rows, grads)


@pytest.mark.parametrize("name", ["lamb", "partial_rowwise_lamb"])
def test_lamb_zero_weight_row_stays_put(name):
    # FBGEMM: true_ratio = weight_norm / rtw_norm = 0, so a zero row never moves.
    table, grads = _data()
    table[3] = 0.0
    new_table, state = _one_step(DEFAULTS[name], table, [3, 5], grads[0][:2])
    np.testing.assert_array_equal(np.asarray(new_table)[3], 0.0)
    assert np.asarray(state.momentum1)[3].any()  # the moments still advance
    assert not np.allclose(np.asarray(new_table)[5], table[5])


@pytest.mark.parametrize("name", ["lamb", "partial_rowwise_lamb"])
def test_lamb_zero_update_is_finite(name):
    # FBGEMM: rtw = 0 (zero gradient, first step, wd = 0) gives inf * 0 = NaN; here no update.
    table, grads = _data()
    g = np.stack([np.zeros(DIM, np.float32), grads[0][1]])
    new_table, _ = _one_step(DEFAULTS[name], table, [3, 5], g)
    np.testing.assert_array_equal(np.asarray(new_table)[3], table[3])
    assert np.isfinite(np.asarray(new_table)).all()


def test_lars_zero_norms():
    optimizer = DEFAULTS["lars_sgd"]
    table, grads = _data()
    table[5] = 0.0
    # Step 1: row 3 gets momentum; row 5 has ||w|| = 0, so FBGEMM's adjusted_lr = 0.
    t1, s1 = _one_step(optimizer, table, [3, 5], grads[0][:2])
    np.testing.assert_array_equal(np.asarray(t1)[5], 0.0)
    np.testing.assert_array_equal(np.asarray(s1.momentum1)[5], 0.0)
    # Step 2: zero gradient, wd = 0, so the denominator is 0 (NaN in FBGEMM): m = momentum*m.
    t2, s2 = _one_step(optimizer, t1, [3], np.zeros((1, DIM), np.float32), s1)
    m = np.asarray(s1.momentum1)[3] * 0.9
    np.testing.assert_allclose(np.asarray(s2.momentum1)[3], m, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(t2)[3], np.asarray(t1)[3] - m, rtol=1e-6)


# ----- contract suite: every optimizer x table dtype -----

DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]
LOW_PRECISION_RTOL = {jnp.float16: 2**-10, jnp.bfloat16: 2**-7}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", NAMES)
def test_contract(name, dtype):
    optimizer = DEFAULTS[name]
    assert isinstance(optimizer, optim.SparseOptimizer)
    table0, grads = _data()
    table = jnp.asarray(table0, dtype)
    state = optimizer.init(NUM_ROWS, DIM)

    # Layout: an int32 count, float32 per-row fields sized as FBGEMM sizes them.
    assert state.count.dtype == jnp.int32 and state.count.shape == ()
    assert optim.base.row_fields(state) == tuple(STATE_LAYOUT[name])
    for field, rowwise in STATE_LAYOUT[name].items():
        arr = getattr(state, field)
        assert arr.shape == ((NUM_ROWS,) if rowwise else (NUM_ROWS, DIM)), field
        assert arr.dtype == jnp.float32, field

    struct0 = jax.tree.structure(state)
    specs0 = [(a.shape, a.dtype) for a in jax.tree.leaves(state)]
    for t, (rows, g) in enumerate(zip(STEP_ROWS[:2], grads, strict=False), start=1):
        prev = table
        table, state = apply_rows(optimizer, table, state, jnp.asarray(rows), jnp.asarray(g))
        assert table.dtype == dtype and table.shape == (NUM_ROWS, DIM)
        assert jax.tree.structure(state) == struct0
        assert [(a.shape, a.dtype) for a in jax.tree.leaves(state)] == specs0
        assert int(state.count) == t
        if t == 1 and dtype != jnp.float32:
            # Updated in float32 and cast back: the same step on the upcast table, rounded.
            ref_table, _ = apply_rows(
                optimizer,
                prev.astype(jnp.float32),
                optimizer.init(NUM_ROWS, DIM),
                jnp.asarray(rows),
                jnp.asarray(g),
            )
            np.testing.assert_allclose(
                np.asarray(table, np.float32),
                np.asarray(ref_table.astype(dtype), np.float32),
                rtol=LOW_PRECISION_RTOL[dtype],
                atol=1e-6,
            )

    untouched = np.asarray(jnp.asarray(table0, dtype), np.float32)[NEVER_TOUCHED]
    np.testing.assert_array_equal(np.asarray(table, np.float32)[NEVER_TOUCHED], untouched)

    # Fill ids only: nothing but the step count changes.
    rows = jnp.full((5,), FILL)
    new_table, new_state = apply_rows(optimizer, table, state, rows, jnp.ones((5, DIM)))
    np.testing.assert_array_equal(np.asarray(new_table), np.asarray(table))
    for field in STATE_LAYOUT[name]:
        np.testing.assert_array_equal(getattr(new_state, field), getattr(state, field))
    assert int(new_state.count) == int(state.count) + 1


# ----- weight decay modes -----


def test_weight_decay_mode_values():
    assert [m.value for m in WDM] == ["NONE", "L2", "DECOUPLE"]
    assert WDM("L2") is WDM.L2


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad"])
def test_weight_decay_mode_accepts_values(name):
    for mode in WDM:
        by_value = FACTORIES[name](LR, weight_decay=0.1, weight_decay_mode=mode.value)
        assert by_value.hyperparams["weight_decay_mode"] == mode.value
        assert by_value.params.weight_decay_mode is mode


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("bad", ["l2", "COUNTER", 1, None])
def test_bad_weight_decay_mode(name, bad):
    with pytest.raises(ValueError, match="weight_decay_mode="):
        FACTORIES[name](LR, weight_decay=0.1, weight_decay_mode=bad)


KINDS = {
    "sgd": optim.EmbOptimType.EXACT_SGD,
    "adagrad": optim.EmbOptimType.EXACT_ADAGRAD,
    "rowwise_adagrad": optim.EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adam": optim.EmbOptimType.ADAM,
    "partial_rowwise_adam": optim.EmbOptimType.PARTIAL_ROWWISE_ADAM,
    "lamb": optim.EmbOptimType.LAMB,
    "partial_rowwise_lamb": optim.EmbOptimType.PARTIAL_ROWWISE_LAMB,
    "lars_sgd": optim.EmbOptimType.LARS_SGD,
}


@pytest.mark.parametrize("name", NAMES)
def test_kind_and_typed_hyperparameters(name):
    """Each optimizer has FBGEMM's kind and its factory's keyword arguments as typed
    fields (what native kernels read); ``name`` and ``hyperparams`` print them."""
    factory = FACTORIES[name]
    opt = factory(LR)
    assert opt.kind is KINDS[name] and opt.name == KINDS[name].value
    params = inspect.signature(factory).parameters
    defaults = {k: p.default for k, p in params.items() if k != "learning_rate"}
    assert opt.params._fields == tuple(defaults)
    assert opt.params == tuple(
        WDM(v) if k == "weight_decay_mode" else v for k, v in defaults.items()
    )
    shown = {k: v.value if isinstance(v, WDM) else v for k, v in defaults.items()}
    assert opt.hyperparams == shown
    custom = optim.SparseOptimizer(opt.init, opt.update, None, LR)
    assert custom.name == "CUSTOM" and custom.params == () and custom.hyperparams == {}


def test_optimizer_is_a_static_argument():
    opt = DEFAULTS["sgd"]
    assert hash(opt) == hash(opt) and opt == opt
    assert opt != FACTORIES["sgd"](LR)  # identity, not field equality
