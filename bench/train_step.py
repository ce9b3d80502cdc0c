"""Train-step benchmark: jaxrec's sparse step vs dense autodiff vs TorchRec's fused step.

Times one training step of an EBC-only model whose loss is
``sum(pooled * R)`` for a fixed random ``R`` (FBGEMM's benchmark backpropagates
a random output gradient the same way), so the step is embedding-bound:

* ``jaxrec``: ``make_train_step`` with ``CombinedOptimizer(optax.sgd(0.0), <sparse>)``:
  row gradients of the touched rows only, fused update into the donated table.
* ``dense``: plain JAX, ``jax.value_and_grad`` of the same EBC forward with
  respect to the stacked table (a dense ``[rows, dim]`` gradient) and an optax
  update of the whole table, state donated.
* ``torchrec`` (when importable): ``DistributedModelParallel`` at world size 1
  (gloo, CPU), tables ``TABLE_WISE`` on the ``FUSED`` kernel, so ``backward()``
  applies FBGEMM's fused optimizer.

Prints one JSON line per implementation, then a ``ratios`` line (jaxrec's
speed-up over each). Correctness is checked once per run: after one step from
identical weights and batch, every table must equal jaxrec's (touched rows
within a rounding tolerance, untouched rows by their exact row sums); the run
exits 1 if not. Implementations run one after another, each freed before the
next. ``--loss tanh`` puts a nonlinearity between the lookup and the loss.

Run from the repository root with jaxrec installed (``pip install -e .``)::

    python bench/train_step.py --preset tiny
    python bench/train_step.py --preset default --reps 5   # ~11 GiB peak RSS
    python bench/train_step.py --preset small --optimizer sgd --impl jaxrec,dense
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import (  # noqa: E402
    EPS,
    add_spec_args,
    build_jaxrec,
    jaxrec_kjt,
    record,
    specs_from_args,
    time_ms,
    torchrec_available,
    torchrec_kjt,
    torchrec_tables,
)
from flax import nnx
from specs import LookupSpec, make_inputs  # noqa: E402

from jaxrec import EmbeddingTable, optim
from jaxrec.embedding import CombinedOptimizer
from jaxrec.train import init_train_state, make_train_step

BENCH = "train_step"
IMPLS = ("jaxrec", "dense", "torchrec")
OPT_EPS = 1e-8  # FBGEMM's default eps
# --optimizer -> FBGEMM's EmbOptimType name and jaxrec's sparse optimizer.
OPTIMIZERS: dict[str, tuple[str, Callable]] = {
    "sgd": ("EXACT_SGD", lambda lr: optim.sgd(lr)),
    "rowwise_adagrad": ("EXACT_ROWWISE_ADAGRAD", lambda lr: optim.rowwise_adagrad(lr, OPT_EPS)),
    "adagrad": ("EXACT_ADAGRAD", lambda lr: optim.adagrad(lr, OPT_EPS)),
}
# "linear" is FBGEMM's set-up; under "tanh" the gradient depends on the forward.
LOSSES = {"linear": lambda x: x, "tanh": jnp.tanh}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    optimizer: str = "rowwise_adagrad"
    lr: float = 0.1
    loss: str = "linear"
    reps: int = 10
    warmup: int = 2
    seed: int = 0

    def fields(self) -> dict:
        name = OPTIMIZERS[self.optimizer][0]
        return {"optimizer": name, "learning_rate": self.lr, "loss": self.loss}


def jax_loss(cfg: Config) -> Callable:
    """``loss(ebc, (kjt, R)) = sum(f(pooled) * R)``."""
    f = LOSSES[cfg.loss]
    return lambda ebc, batch: jnp.sum(f(ebc(batch[0]).values()) * batch[1])


# ----- correctness: touched rows compared, untouched rows by exact row sums -----
@dataclasses.dataclass
class Snapshot:
    rows: list[np.ndarray]  # per table: the batch's touched rows [U_t, D] float32
    row_sums: list[np.ndarray]  # per table: float64 sum of every row [E]


def touched_rows(spec: LookupSpec, inputs: dict) -> tuple[list[np.ndarray], int]:
    """Sorted distinct rows each table's feature reads, and the most repeats of one row."""
    ids = inputs["values"].reshape(spec.T, spec.B * spec.L)
    uniq = [np.unique(r, return_counts=True) for r in ids]
    return [u for u, _ in uniq], int(max(c.max() for _, c in uniq))


def snapshot(tables: Sequence[np.ndarray], touched: Sequence[np.ndarray]) -> Snapshot:
    """Per-table views ``[E, D]`` (numpy, not copied) -> what the check compares."""
    return Snapshot(
        [np.asarray(w[r], np.float32) for w, r in zip(tables, touched, strict=True)],
        [np.add.reduce(w, axis=1, dtype=np.float64) for w in tables],
    )


def compare(ref: Snapshot, other: Snapshot, touched: Sequence[np.ndarray]) -> dict:
    diff, changed = 0.0, 0
    for t, rows in enumerate(touched):
        if rows.size:
            diff = max(diff, float(np.max(np.abs(ref.rows[t] - other.rows[t]))))
        untouched = np.ones(ref.row_sums[t].shape, bool)
        untouched[rows] = False
        changed += int(np.sum(untouched & (ref.row_sums[t] != other.row_sums[t])))
    return {"max_abs_diff_vs_jaxrec": diff, "untouched_rows_changed": changed}


def tolerance(spec: LookupSpec, ref: Snapshot, repeats: int) -> float:
    """A few ulps of the largest updated weight, growing with the rows' summed occurrences."""
    scale = max((float(np.max(np.abs(r))) for r in ref.rows if r.size), default=0.0)
    return 16 * EPS[spec.dtype] * scale * max(1.0, repeats**0.5)


def _drive(one: Callable[[], None], tables: Callable, cfg: Config, touched) -> tuple:
    """One step (compiles; then the snapshot), ``warmup`` untimed steps, ``reps`` timed."""
    one()
    snap = snapshot(tables(), touched)
    return time_ms(one, cfg.reps, cfg.warmup), snap


def _split_rows(stacked: jax.Array, spec: LookupSpec) -> list[np.ndarray]:
    w = np.asarray(stacked)  # a zero-copy view on CPU
    return [w[t * spec.E : (t + 1) * spec.E] for t in range(spec.T)]


def _stacked(tables: nnx.State) -> jax.Array:
    (leaf,) = jax.tree.leaves(tables)  # one group: every table has the same (D, dtype)
    return leaf


# ----- (a) jaxrec -----
def run_jaxrec(spec, cfg, batch, touched, ebc) -> tuple[dict, Snapshot]:
    opt = CombinedOptimizer(optax.sgd(0.0), OPTIMIZERS[cfg.optimizer][1](cfg.lr))
    graphdef, state = init_train_state(ebc, opt)
    step = make_train_step(graphdef, opt, jax_loss(cfg))
    box = [state]
    del ebc, state

    def one():
        box[0], _, _ = step(box[0], batch)
        jax.block_until_ready(box[0])

    times, snap = _drive(one, lambda: _split_rows(_stacked(box[0].tables), spec), cfg, touched)
    return record(BENCH, spec, "jaxrec", times, **cfg.fields()), snap


# ----- (b) dense autodiff baseline -----
def dense_adagrad(learning_rate: float, eps: float, rowwise: bool) -> optax.GradientTransformation:
    """FBGEMM's (row-wise) Adagrad over whole tables, as an optax transformation.

    Unlike ``optax.adagrad``: ``eps`` outside the sqrt and a zero initial
    accumulator; row-wise keeps one accumulator per row (``mean_d(g*g)``).
    Rows with a zero gradient keep their weights, as FBGEMM's untouched rows.
    """

    def acc(g):
        g = g.astype(jnp.float32)
        return jnp.mean(g * g, axis=-1) if rowwise else g * g

    def init(params):
        return jax.tree.map(lambda p: jnp.zeros(jnp.shape(acc(p)), jnp.float32), params)

    def update(grads, state, params=None):
        del params
        state = jax.tree.map(lambda g, m: m + acc(g), grads, state)

        def direction(g, m):
            g = g.astype(jnp.float32)
            if rowwise:  # the same operation order as jaxrec's (and FBGEMM's) update
                return -((learning_rate / (jnp.sqrt(m) + eps))[:, None] * g)
            return -(learning_rate * g / (jnp.sqrt(m) + eps))

        return jax.tree.map(direction, grads, state), state

    return optax.GradientTransformation(init, update)


DENSE = {
    "sgd": ("optax.sgd", lambda lr: optax.sgd(lr)),
    "rowwise_adagrad": (
        "dense_adagrad(rowwise=True): FBGEMM formula as an optax transformation",
        lambda lr: dense_adagrad(lr, OPT_EPS, rowwise=True),
    ),
    "adagrad": (
        "dense_adagrad(rowwise=False): FBGEMM formula as an optax transformation",
        lambda lr: dense_adagrad(lr, OPT_EPS, rowwise=False),
    ),
}


def run_dense(spec, cfg, batch, touched, ebc) -> tuple[dict, Snapshot]:
    name, factory = DENSE[cfg.optimizer]
    tx = factory(cfg.lr)
    graphdef, tables, rest = nnx.split(ebc, EmbeddingTable, ...)
    loss_fn = jax_loss(cfg)

    def step(carry, batch):
        tables, opt_state = carry
        loss = lambda tables: loss_fn(nnx.merge(graphdef, tables, rest), batch)
        _, grads = jax.value_and_grad(loss)(tables)  # dense [rows, D]
        updates, opt_state = tx.update(grads, opt_state, tables)
        return optax.apply_updates(tables, updates), opt_state

    step = jax.jit(step, donate_argnums=(0,))
    box = [(tables, tx.init(tables))]
    del ebc, tables

    def one():
        box[0] = step(box[0], batch)
        jax.block_until_ready(box[0])

    times, snap = _drive(one, lambda: _split_rows(_stacked(box[0][0]), spec), cfg, touched)
    extra = {"baseline": "jax.value_and_grad w.r.t. the stacked table", "dense_optimizer": name}
    return record(BENCH, spec, "dense", times, **cfg.fields(), **extra), snap


# ----- (c) TorchRec, FBGEMM fused optimizer -----
def build_fused_torchrec(spec: LookupSpec, cfg: Config):
    """TorchRec EBC sharded by DMP (world size 1), tables on the FUSED kernel."""
    import torch
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.distributed.types import ShardingType

    tables = torchrec_tables(spec)
    meta = torchrec.EmbeddingBagCollection(
        tables, is_weighted=spec.weighted, device=torch.device("meta")
    )
    fused = {"learning_rate": cfg.lr, "eps": OPT_EPS}
    fused["optimizer"] = EmbOptimType[OPTIMIZERS[cfg.optimizer][0]]
    sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    only = ParameterConstraints(
        sharding_types=[ShardingType.TABLE_WISE.value],
        compute_kernels=[EmbeddingComputeKernel.FUSED.value],
    )
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"),
        constraints={t.name: only for t in tables},
    )
    plan = planner.collective_plan(meta, [sharder], torch.distributed.GroupMember.WORLD)
    return DistributedModelParallel(meta, device=torch.device("cpu"), sharders=[sharder], plan=plan)


def run_torchrec(spec, cfg, inputs, proj, touched, ebc) -> tuple[dict, Snapshot]:
    import torch
    import torch.distributed as dist
    import torchrec

    torch.set_num_threads(os.cpu_count() or 1)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dmp = build_fused_torchrec(spec, cfg)
        weights = [dmp.module.embedding_bags[f"t{t}"].weight for t in range(spec.T)]
        initial = _split_rows(_stacked(nnx.state(ebc, EmbeddingTable)), spec)
        for w, w0 in zip(weights, initial, strict=True):
            w.detach().numpy()[:] = w0  # jaxrec's initial weights
        del ebc, initial
        gc.collect()
        kjt, r = torchrec_kjt(inputs), torch.from_numpy(proj)
        f = {"linear": lambda x: x, "tanh": torch.tanh}[cfg.loss]

        def one():
            (f(dmp(kjt).wait().values()) * r).sum().backward()  # applies the fused update

        tables = lambda: [w.detach().numpy() for w in weights]
        times, snap = _drive(one, tables, cfg, touched)
    finally:
        if created:
            dist.destroy_process_group()
    extra = {
        "device_kind": "cpu",
        "platform": "cpu",
        "torchrec_step": "DistributedModelParallel world_size=1 gloo, TABLE_WISE, FUSED kernel",
        "torch_version": torch.__version__,
        "torchrec_version": getattr(torchrec, "__version__", "unknown"),
        "torch_threads": torch.get_num_threads(),
    }
    return record(BENCH, spec, "torchrec", times, **cfg.fields(), **extra), snap


# ----- driver -----
def run(spec: LookupSpec, impls: Sequence[str] = IMPLS, cfg: Config | None = None) -> list[dict]:
    """Benchmarks ``spec`` with each implementation; returns the JSON records.

    Returns:
        One record per implementation that ran (TorchRec is left out when not
        importable), then a ``ratios`` record with the check's verdict.
    """
    cfg = cfg or Config()
    bad = sorted(set(impls) - set(IMPLS))
    if bad or cfg.optimizer not in OPTIMIZERS or cfg.loss not in LOSSES:
        raise ValueError(f"unknown impls {bad} (from {IMPLS}) or {cfg.optimizer=} or {cfg.loss=}")
    inputs = make_inputs(spec, cfg.seed)
    proj = np.random.default_rng(cfg.seed + 1).standard_normal((spec.B, spec.T * spec.D))
    proj = proj.astype(np.float32)
    batch = (jaxrec_kjt(spec, inputs), jnp.asarray(proj))
    touched, repeats = touched_rows(spec, inputs)
    use_torch = "torchrec" in impls and torchrec_available()
    if use_torch and (spec.dtype != "fp32" or (spec.weighted and spec.pooling == "MEAN")):
        why = "fp32 tables only" if spec.dtype != "fp32" else "weighted MEAN is unsupported"
        print(json.dumps({"bench": BENCH, "impl": "torchrec", "skipped": why}), flush=True)
        use_torch = False

    records, snaps = {}, {}

    def emit(impl, result):
        records[impl], snaps[impl] = result
        if impl != "jaxrec" and "jaxrec" in snaps:
            records[impl].update(compare(snaps["jaxrec"], snaps[impl], touched))
        print(json.dumps(records[impl]), flush=True)
        gc.collect()

    if "jaxrec" in impls:
        emit("jaxrec", run_jaxrec(spec, cfg, batch, touched, build_jaxrec(spec, seed=cfg.seed)))
    if use_torch or "dense" in impls:  # one build: TorchRec copies it, then dense consumes it
        ebc = build_jaxrec(spec, seed=cfg.seed)
        if use_torch:
            emit("torchrec", run_torchrec(spec, cfg, inputs, proj, touched, ebc))
        if "dense" in impls:
            emit("dense", run_dense(spec, cfg, batch, touched, ebc))
        del ebc
    return [*records.values(), _ratios(spec, cfg, records, snaps, repeats)]


def _ratios(spec, cfg, records, snaps, repeats) -> dict:
    line = {"bench": BENCH, "impl": "ratios", **spec.as_dict(), **cfg.fields()}
    base = records.get("jaxrec")
    for impl in ("dense", "torchrec"):
        if base and impl in records:
            speedup = records[impl]["median_ms"] / base["median_ms"]
            line[f"jaxrec_speedup_over_{impl}"] = round(speedup, 3)
    line["ratio_meaning"] = "other median_ms / jaxrec median_ms; > 1 means jaxrec is faster"
    if "jaxrec" in snaps:
        tol = tolerance(spec, snaps["jaxrec"], repeats)
        checked = [r for i, r in records.items() if i != "jaxrec"]
        line["tolerance"] = tol
        line["tables_agree"] = all(
            r["max_abs_diff_vs_jaxrec"] <= tol and r["untouched_rows_changed"] == 0 for r in checked
        )
    line["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    print(json.dumps(line), flush=True)
    return line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spec_args(p)
    p.add_argument("--optimizer", default="rowwise_adagrad", choices=sorted(OPTIMIZERS))
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--loss", default="linear", choices=sorted(LOSSES))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", default=",".join(IMPLS), help=f"comma-separated, from {IMPLS}")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(
        optimizer=args.optimizer,
        lr=args.lr,
        loss=args.loss,
        reps=args.reps,
        warmup=args.warmup,
        seed=args.seed,
    )
    agree = True
    for spec in specs_from_args(args):
        agree &= run(spec, args.impl.split(","), cfg)[-1].get("tables_agree", True)
        gc.collect()
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
