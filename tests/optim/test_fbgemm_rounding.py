"""Every optimizer's float32 trajectory against FBGEMM's rounding, to a few ulps.

``fbgemm_float32`` models FBGEMM's kernels with C++'s float / double types;
``test_optimizers`` checks the maths at 1e-5. Here the tolerance is ``ULPS``
float32 ulps of the largest magnitude each element has had so far (its
weight before and after each step), for weights and optimizer state alike,
after several steps in which some rows are touched repeatedly, some once and
some never. jaxrec computes in float32 where FBGEMM keeps some terms in double
and fuses some multiply-adds, so exact equality is not expected; a constant
rounded differently (e.g. ``1 - b2`` taken in double before rounding) drifts
by tens to hundreds of ulps within these steps.

The XLA path (``apply_rows``), the Pallas kernel (interpreted) and the C++
CPU kernels (SGD, Adagrad, row-wise Adagrad) all run; FBGEMM's CPU TBE itself
is checked against the same model where torch and fbgemm_gpu import.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fbgemm_float32 import apply_rows as fbgemm_apply_rows
from numpy_optimizers import STATE_LAYOUT

from jaxrec import cpu, optim
from jaxrec.cpu.kernels import backward_update_cpu
from jaxrec.pallas.update import sparse_update

ULPS = 8
NUM_ROWS, DIM = 12, 12  # Pallas pads rows to 16 columns
FILL = NUM_ROWS  # out of range: skipped
# Row 3 is touched at every step, 0/1/5/7/11 at several, 2/4/8/10 once, 6 and 9 never.
STEP_ROWS = [
    [0, 3, 5, 7, FILL],
    [3, 1, 8, FILL, FILL],
    [5, 3, 10, 11, FILL],
    [0, 1, 3, 11, 7],
    [2, 3, 5, FILL, FILL],
    [0, 1, 4, 3, FILL],
]
NEVER_TOUCHED = [6, 9]
L2, DEC, NONE = "L2", "DECOUPLE", "NONE"
SCHEDULE = optax.linear_schedule(0.1, 0.02, 4)
CPU_KERNEL_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")


def _case(name, lr=0.05, start=0, **hp):
    """``start``: the step count before the first step (Adam's bias corrections use it)."""
    parts = [name, "schedule" if callable(lr) else f"lr={lr}", f"t0={start}"]
    label = "-".join(parts + [f"{k}={v}" for k, v in hp.items()])
    return pytest.param(name, lr, start, hp, id=label)


CASES = [
    _case("sgd"),
    _case("sgd", 0.5, weight_decay=0.1, weight_decay_mode=L2),
    _case("sgd", weight_decay=0.1, weight_decay_mode=DEC),
    _case("sgd", SCHEDULE),
    _case("adagrad", 0.5),
    _case("adagrad", eps=1e-3, weight_decay=0.1, weight_decay_mode=L2),
    _case("adagrad", 0.5, weight_decay=0.1, weight_decay_mode=DEC),
    _case("rowwise_adagrad", 0.5, weight_decay=0.1, weight_decay_mode=NONE),
    _case("rowwise_adagrad", weight_decay=0.1, weight_decay_mode=L2),
    _case("rowwise_adagrad", 0.5, eps=1e-2, weight_decay=0.05, weight_decay_mode=L2),
    _case("rowwise_adagrad", 0.5, weight_decay=0.1, weight_decay_mode=DEC),
    _case("rowwise_adagrad", SCHEDULE, weight_decay=0.1, weight_decay_mode=DEC),
]
for _name in ("adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb"):
    CASES += [
        _case(_name),
        _case(_name, 0.5, weight_decay=0.01),
        _case(_name, start=1000, weight_decay=0.01),
        _case(_name, 0.5, start=99_999, b1=0.5, b2=0.9, eps=1e-4),
    ]
CASES += [
    _case("adam", 0.5, b1=0.8, b2=0.9999),  # 1 - b2^t ~ 1e-4 at first: amplifies any error
    _case("adam", 0.5, start=507, b2=0.9999),  # XLA's CPU pow(0.9999, 508) is an ulp off
    _case("adam", SCHEDULE, start=7),
    _case("lars_sgd"),
    _case("lars_sgd", 0.5, eta=0.1, momentum=0.5, weight_decay=0.01),
    _case("lars_sgd", SCHEDULE, start=3, eta=0.3),
]


def _data(seed=0, aligned=False):
    """A table and each step's gradients; ``aligned``: gradients take the sign of the
    initial weights, so that L2's ``g + wd * w`` never cancels (XLA fuses it into one
    FMA, the C++ kernels round twice: under cancellation that one rounding is all of
    the result, and Adagrad's accumulator would show it as tens of ulps)."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
    grads = [rng.normal(size=(len(r), DIM)).astype(np.float32) for r in STEP_ROWS]
    if aligned:
        sign = np.sign(np.concatenate([table, np.ones((1, DIM), np.float32)]))
        grads = [np.abs(g) * sign[np.asarray(r)] for g, r in zip(grads, STEP_ROWS, strict=True)]
    return table, grads


def _zero_state(name):
    return {
        f: np.zeros((NUM_ROWS,) if rowwise else (NUM_ROWS, DIM), np.float32)
        for f, rowwise in STATE_LAYOUT[name].items()
    }


def _lr(lr, t):
    """The float32 learning rate of step ``t`` (1-based), as jaxrec and FBGEMM's tensor hold it."""
    return np.float32(lr(t - 1)) if callable(lr) else np.float32(lr)


class UlpTracker:
    """Compares arrays with a reference to ``ULPS`` ulps of each element's largest
    magnitude so far, initial value included (an update is at most the values
    before and after it; errors carried from earlier steps stay on that scale)."""

    def __init__(self, **initial):
        self.scale = {k: np.abs(np.asarray(v, np.float32)) for k, v in initial.items()}

    def check(self, key, got, want, where):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert got.shape == want.shape, f"{key}: {got.shape} != {want.shape}"
        scale = np.maximum(self.scale.get(key, 0.0), np.abs(want))
        self.scale[key] = scale
        ulps = np.abs(got - want) / np.spacing(scale)
        worst = np.unravel_index(np.argmax(ulps), ulps.shape)
        assert ulps[worst] <= ULPS, (
            f"{key} at {where}: {ulps[worst]:.1f} ulps at {worst} "
            f"(got {got[worst]!r}, FBGEMM model {want[worst]!r})"
        )


def _pallas_step(opt, table, state, rows, grads):
    return sparse_update(opt, table, state, rows, grads, interpret=True)


@jax.jit(static_argnums=0)
def _cpu_step(opt, table, state, rows, grads):
    # One id per gradient row, scale 1: each touched row's gradient is exactly grads[i].
    u = rows.shape[0]
    seg, scale = jnp.arange(u, dtype=jnp.int32), jnp.ones((u,), jnp.float32)
    return backward_update_cpu(opt, table, state, grads, seg, scale, rows, rows < NUM_ROWS)


IMPLEMENTATIONS = {
    "xla": jax.jit(optim.apply_rows, static_argnums=0),
    "pallas": _pallas_step,
    "cpu": _cpu_step,
}


def _run_against_model(impl, name, lr, start, hp):
    optimizer = getattr(optim, name)(lr, **hp)
    step = IMPLEMENTATIONS[impl]
    table0, grads = _data(aligned=hp.get("weight_decay_mode") == L2)
    table = jnp.asarray(table0)
    state = optimizer.init(NUM_ROWS, DIM)._replace(count=jnp.int32(start))
    ref_table, ref_state = table0, _zero_state(name)
    tracker = UlpTracker(weights=table0)
    for i, (rows, g) in enumerate(zip(STEP_ROWS, grads, strict=True)):
        t = start + i + 1
        table, state = step(optimizer, table, state, jnp.asarray(rows, jnp.int32), jnp.asarray(g))
        ref_table, ref_state = fbgemm_apply_rows(
            name, ref_table, ref_state, rows, g, t, _lr(lr, t), **hp
        )
        tracker.check("weights", table, ref_table, f"step {t}")
        for field, ref in ref_state.items():
            tracker.check(field, getattr(state, field), ref, f"step {t}")
        assert int(state.count) == t
    np.testing.assert_array_equal(np.asarray(table)[NEVER_TOUCHED], table0[NEVER_TOUCHED])


@pytest.mark.parametrize("name, lr, start, hp", CASES)
def test_xla_matches_fbgemm_rounding(name, lr, start, hp):
    _run_against_model("xla", name, lr, start, hp)


# The Pallas kernel traces the same row update on rows padded to 16 columns (dim=12).
PALLAS_CASES = [c for c in CASES if "lr=0.5" in c.id and "t0=0" in c.id]


@pytest.mark.parametrize("name, lr, start, hp", PALLAS_CASES)
def test_pallas_matches_fbgemm_rounding(name, lr, start, hp):
    _run_against_model("pallas", name, lr, start, hp)


@pytest.mark.skipif(not cpu.available(), reason=f"{cpu.unavailable_reason()}")
@pytest.mark.parametrize(
    "name, lr, start, hp", [c for c in CASES if c.values[0] in CPU_KERNEL_OPTIMIZERS]
)
def test_cpu_kernel_matches_fbgemm_rounding(name, lr, start, hp):
    _run_against_model("cpu", name, lr, start, hp)


# ----- FBGEMM's own CPU TBE (EXACT_SGD / EXACT_ADAGRAD / EXACT_ROWWISE_ADAGRAD) -----

FBGEMM_CASES = [
    ("sgd", 0.5, {}),
    ("adagrad", 0.5, {"eps": 1e-3}),
    ("rowwise_adagrad", 0.5, {"eps": 1e-8}),
    ("rowwise_adagrad", 0.05, {"eps": 1e-2, "weight_decay": 0.1, "weight_decay_mode": L2}),
    ("rowwise_adagrad", 0.5, {"eps": 1e-8, "weight_decay": 0.1, "weight_decay_mode": DEC}),
]


def _fbgemm_tbe(name, lr, hp):
    """A CPU TBE over one ``[R, D]`` table read by two features (FBGEMM's CPU fast path for a
    single-feature fp32 table drops weight decay; DESIGN.md section 4)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )
    from fbgemm_gpu.tbe.config import WeightDecayMode

    kwargs = {"learning_rate": lr, "eps": hp.get("eps", 0.0)}
    if "weight_decay_mode" in hp:
        kwargs["weight_decay"] = hp["weight_decay"]
        kwargs["weight_decay_mode"] = getattr(WeightDecayMode, hp["weight_decay_mode"])
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(NUM_ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        feature_table_map=[0, 0],
        optimizer=getattr(EmbOptimType, "EXACT_" + name.upper()),
        pooling_mode=PoolingMode.SUM,
        **kwargs,
    )


# fbgemm_gpu's CPU wheel warns at import about its missing GPU-only (SSD) modules.
@pytest.mark.filterwarnings("ignore::DeprecationWarning:fbgemm_gpu.*")
@pytest.mark.parametrize(
    "name, lr, hp", FBGEMM_CASES, ids=[f"{n}-lr={lr}-{hp}" for n, lr, hp in FBGEMM_CASES]
)
def test_fbgemm_cpu_tbe_matches_model_and_jaxrec(name, lr, hp):
    torch = pytest.importorskip("torch")
    pytest.importorskip("fbgemm_gpu")
    tbe = _fbgemm_tbe(name, lr, hp)
    table0, grads = _data(seed=1, aligned=hp.get("weight_decay_mode") == L2)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(torch.from_numpy(table0))
    optimizer = getattr(optim, name)(lr, **hp)
    xla_step = IMPLEMENTATIONS["xla"]
    table, state = jnp.asarray(table0), optimizer.init(NUM_ROWS, DIM)
    ref_table, ref_state = table0, _zero_state(name)
    model_vs_fbgemm, jaxrec_vs_fbgemm = UlpTracker(weights=table0), UlpTracker(weights=table0)
    for t, (rows, g) in enumerate(zip(STEP_ROWS, grads, strict=True), start=1):
        keep = [i for i, r in enumerate(rows) if r < NUM_ROWS]
        ids, u = [rows[i] for i in keep], len(keep)
        # Feature 0: one id per bag; feature 1 (same table): U empty bags.
        offsets = torch.tensor(list(range(u + 1)) + [u] * u, dtype=torch.int64)
        out = tbe(torch.tensor(ids, dtype=torch.int64), offsets)
        out_grad = torch.zeros_like(out)
        out_grad[:, :DIM] = torch.from_numpy(g[keep])
        out.backward(out_grad)  # FBGEMM applies the optimizer to the touched rows here
        theirs = tbe.split_embedding_weights()[0].detach().numpy()
        # One list of state tensors per table; SGD has no state (an empty list).
        their_state = [
            s.detach().numpy() for per_table in tbe.split_optimizer_states() for s in per_table
        ]

        table, state = xla_step(optimizer, table, state, jnp.asarray(rows), jnp.asarray(g))
        ref_table, ref_state = fbgemm_apply_rows(name, ref_table, ref_state, rows, g, t, lr, **hp)
        model_vs_fbgemm.check("weights", ref_table, theirs, f"model, step {t}")
        jaxrec_vs_fbgemm.check("weights", table, theirs, f"jaxrec, step {t}")
        for (field, ref), theirs_field in zip(ref_state.items(), their_state, strict=True):
            theirs_field = theirs_field.reshape(ref.shape)
            model_vs_fbgemm.check(field, ref, theirs_field, f"model, step {t}")
            jaxrec_vs_fbgemm.check(field, getattr(state, field), theirs_field, f"jaxrec, step {t}")


# ----- the bias corrections' powf -----


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 0.999, 0.9999, 0.99999, 1.0, -0.9, 1.001])
def test_powf_is_correctly_rounded(beta):
    # FBGEMM's powf(beta, iter), modelled as correctly rounded (float64 pow, rounded once).
    from jaxrec.optim.optimizers import _powers_of_two, _powf

    t = np.concatenate([np.arange(0, 20_000), [65_535, 65_536, 2**24 + 1, 2**31 - 1]])
    t = t.astype(np.int32)
    pairs = _powers_of_two(beta)
    got = np.asarray(jax.jit(jax.vmap(lambda c: _powf(beta, pairs, c)))(t))
    with np.errstate(over="ignore"):
        want = (np.float64(np.float32(beta)) ** t.astype(np.float64)).astype(np.float32)
    # Below 2**-60 the two-float pairs lose bits (and 1 - p rounds to 1 all the same);
    # above 2**60 (beta > 1, not a usable beta) only the size is checked.
    normal = (np.abs(want) > 2.0**-60) & (np.abs(want) < 2.0**60)
    np.testing.assert_array_equal(got[normal], want[normal])
    assert np.all(np.abs(got[np.abs(want) <= 2.0**-60]) <= 2.0**-59)
    assert np.all(np.abs(got[np.abs(want) >= 2.0**60]) >= 2.0**59)
