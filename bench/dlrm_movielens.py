"""DLRM on MovieLens-100k, jaxrec and TorchRec side by side on CPU (test AUC, NE, speed).

Both frameworks train the model of ``jaxrec-train-dlrm --dataset movielens``
on the same data, batch for batch:

* one table per sparse feature (``num_embeddings`` from the dataset), dim 16,
  SUM pooling; dense arch ``[64, 16]``, over arch ``[64, 32, 1]``; MovieLens
  has no dense features, so the dense input is a ``[B, 1]`` column of ones
  (what ``jaxrec.jobs.dlrm_parts`` feeds when ``num_dense == 0``);
* dense parameters: Adam (``--dense-lr``, betas 0.9/0.999, eps 1e-8: optax's and
  torch's defaults); tables: row-wise Adagrad (``--sparse-lr``, eps 1e-8,
  accumulators starting at 0), applied to the rows each batch touches;
* BCE with logits, mean over the batch; the same shuffled batches in the same
  order (``TableDataset.batches(B, shuffle=True, seed, epoch)``, last partial
  batch dropped), each jaxrec ``Batch``'s KJT converted to TorchRec's;
* after every epoch, AUC (``jaxrec.metrics.roc_auc``) and NE (log loss over
  the entropy of the test CTR) of the logits over the whole test set, computed
  on the host by the same code for both.

jaxrec runs the job's own pieces (``jaxrec.jobs.dlrm_parts``: ``build_model``,
``build_optimizer``, ``make_steps``) through ``TrainPipeline``, as the job does;
its line also carries the job's ``evaluate()`` AUC as a cross-check. TorchRec
runs ``torchrec.models.dlrm.DLRM`` under ``DistributedModelParallel`` (world
size 1, gloo, the dense part left unwrapped), the tables on the ``FUSED``
kernel with FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` applied in ``backward()``, and
``torch.optim.Adam`` over the dense parameters: TorchRec's DLRM recipe.

``--init`` sets where the initial weights come from: ``jaxrec`` (default; the
TorchRec model is loaded with jaxrec's initial weights, so the runs differ only
by floating-point order) or ``own`` (each framework draws its default init:
the same distributions, different draws). With shared weights, a ``check``
line compares the two models' parameters after ``--check-steps`` steps: the
optimizer maths (dense and sparse) of both must agree.

Throughput is training samples per second over each epoch's training loop
(batch preparation included, evaluation excluded); jaxrec's first epoch
includes its compilations. Each framework (and the check) runs in its own
process: with JAX and TorchRec in one process, TorchRec's first epochs ran
~10-100x slower (thread pools competing for the two cores).

Prints JSON lines: one per framework per epoch, a ``check`` line, and a final
``summary`` line with both final AUCs and their difference. Run from the
repository root with jaxrec and the TorchRec extras installed::

    python bench/dlrm_movielens.py                       # ml-100k, 3 epochs
    python bench/dlrm_movielens.py --epochs 4 --init own
    python bench/dlrm_movielens.py --synthetic-tiny      # seconds: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from common import cpu_model, torchrec_available  # noqa: E402

import jaxrec
from jaxrec.metrics import roc_auc

BENCH = "dlrm_movielens"
EPS = 1e-8  # row-wise Adagrad's eps: jaxrec's rowwise_adagrad default, as FBGEMM's
EBC = "sparse_arch.embedding_bag_collection"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--sparse-lr", type=float, default=0.02)
    p.add_argument("--dense-lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", help="a MovieLens folder (default: fetch ml-100k)")
    p.add_argument(
        "--synthetic-tiny",
        action="store_true",
        help="a few thousand synthetic Criteo-like samples instead of MovieLens (smoke test)",
    )
    p.add_argument("--init", default="jaxrec", choices=("jaxrec", "own"))
    p.add_argument("--check-steps", type=int, default=3, help="0: no parameter check")
    p.add_argument("--frameworks", default="jaxrec,torchrec")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument("--worker", choices=("check", "jaxrec", "torchrec"), help=argparse.SUPPRESS)
    p.add_argument("--init-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----- data -----
def load(args: argparse.Namespace):
    from jaxrec import datasets

    if args.synthetic_tiny:
        sizes = [50] * 26
        return datasets.synthetic_criteo_split(
            num_train=2048, num_eval=1024, seed=args.seed, num_embeddings_per_feature=sizes
        )
    path = args.data_dir or datasets.fetch_movielens_100k()
    return datasets.movielens_split(path, seed=args.seed)


def job_args(args: argparse.Namespace) -> argparse.Namespace:
    """The ``jaxrec-train-dlrm`` flags of the same model and optimizers."""
    from jaxrec.jobs.train_dlrm import parse_args as job_parse_args

    return job_parse_args(
        [
            *("--dataset", "synthetic" if args.synthetic_tiny else "movielens"),
            *("--batch-size", str(args.batch_size), "--epochs", str(args.epochs)),
            *("--dense-lr", str(args.dense_lr), "--sparse-lr", str(args.sparse_lr)),
            *("--seed", str(args.seed), "--embedding-dim", "16"),
            *("--dense-arch", "64,16", "--over-arch", "64,32,1"),
        ]
    )


def dense_input(batch) -> np.ndarray:
    """The dense features, or a ``[B, 1]`` ones column when there are none (as the job)."""
    dense = np.asarray(batch.dense_features, np.float32)
    return np.ones((dense.shape[0], 1), np.float32) if dense.shape[1] == 0 else dense


def _jax_dense_input(batch) -> jax.Array:
    """:func:`dense_input` under ``jit`` (``jaxrec.jobs.dlrm_parts``' rule)."""
    dense = batch.dense_features
    return jnp.ones((dense.shape[0], 1), jnp.float32) if dense.shape[1] == 0 else dense


def train_batches(data, args, epoch: int) -> Iterator:
    return data.batches(args.batch_size, shuffle=True, seed=args.seed, epoch=epoch)


def test_batches(data, args) -> Iterator:
    return data.batches(args.batch_size, shuffle=False, drop_last=False)


def kjt_arrays(kjt) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``(keys, values, lengths)`` in TorchRec's layout: only the valid ids of each key.

    A jaxrec KJT packs each key's ids at the start of a fixed-capacity slot.
    """
    keys = list(kjt.keys())
    lengths = np.asarray(kjt.lengths())
    b = lengths.shape[0] // len(keys)
    per_key = lengths.reshape(len(keys), b)
    values = [np.asarray(kjt[k].values())[: per_key[i].sum()] for i, k in enumerate(keys)]
    return keys, np.concatenate(values).astype(np.int64), lengths.astype(np.int32)


def metrics(labels: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    """Test AUC and NE (mean BCE over the entropy of the test CTR) from logits, numpy."""
    y, z = np.asarray(labels, np.float64), np.asarray(logits, np.float64)
    bce = np.mean(np.logaddexp(0.0, z) - y * z)
    ctr = np.clip(y.mean(), 1e-12, 1 - 1e-12)
    base = -(ctr * np.log(ctr) + (1 - ctr) * np.log(1 - ctr))
    return {"auc": roc_auc(y, z), "ne": float(bce / base), "logloss": float(bce)}


def line(framework: str, epoch: int, m: dict, samples: int, seconds: float, **extra) -> dict:
    return {
        "bench": BENCH,
        "framework": framework,
        "epoch": epoch,
        "test_auc": round(m["auc"], 5),
        "test_ne": round(m["ne"], 5),
        "test_logloss": round(m["logloss"], 5),
        "train_samples": samples,
        "train_seconds": round(seconds, 3),
        "train_samples_per_s": round(samples / max(seconds, 1e-9), 1),
        **extra,
    }


# ----- jaxrec -----
class JaxrecRun:
    """The job's model, optimizer and steps (``jaxrec.jobs.dlrm_parts``)."""

    def __init__(self, args: argparse.Namespace, train):
        from jaxrec.jobs import dlrm_parts

        self.args, self.jargs = args, job_args(args)
        self.model = dlrm_parts.build_model(self.jargs, train)
        self.initial = jaxrec.modules.torchrec_state_dict(self.model)  # TorchRec keys, numpy
        self.optimizer = dlrm_parts.build_optimizer(self.jargs)
        self.graphdef, self.state, self.step, self.eval_step = dlrm_parts.make_steps(
            self.model, self.optimizer, self.jargs
        )
        self.logits_step = jaxrec.train.make_eval_step(
            self.graphdef, lambda m, b: m(_jax_dense_input(b), b.sparse_features)[:, 0]
        )

    def train_epoch(self, data, epoch: int) -> tuple[int, float]:
        pipeline = jaxrec.train.TrainPipeline(self.step, self.state)
        it, n = train_batches(data, self.args, epoch), 0
        start = time.perf_counter()
        while True:
            try:
                pipeline.progress(it)
            except StopIteration:
                break
            n += self.args.batch_size
        jax.block_until_ready(pipeline.state)
        seconds = time.perf_counter() - start
        pipeline.close()
        self.state = pipeline.state
        return n, seconds

    def logits(self, data) -> np.ndarray:
        out = [np.asarray(self.logits_step(self.state, b)) for b in test_batches(data, self.args)]
        return np.concatenate(out)

    def job_auc(self, data) -> float:
        """The job's own ``evaluate()`` AUC (jaxrec.metrics), as a cross-check."""
        from jaxrec.jobs import dlrm_parts

        return dlrm_parts.evaluate(self.eval_step, self.state, data, self.jargs, None)["auc"]

    def params(self) -> dict[str, np.ndarray]:
        model = jaxrec.train.merge_model(self.graphdef, self.state)
        return jaxrec.modules.torchrec_state_dict(model)


# ----- TorchRec -----
class TorchrecRun:
    """``torchrec.models.dlrm.DLRM`` under DMP (world size 1), FBGEMM fused row-wise Adagrad."""

    def __init__(self, args: argparse.Namespace, train, initial: dict[str, np.ndarray] | None):
        import torch
        import torchrec
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embedding_types import EmbeddingComputeKernel
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DataParallelWrapper
        from torchrec.distributed.planner import (
            EmbeddingShardingPlanner,
            ParameterConstraints,
            Topology,
        )
        from torchrec.distributed.types import ShardingType
        from torchrec.models.dlrm import DLRM

        class NoWrap(DataParallelWrapper):
            """World size 1: no DistributedDataParallel around the dense part."""

            def wrap(self, dmp, env, device) -> None:
                del dmp, env, device

        self.args, self.torch, self.torchrec = args, torch, torchrec
        torch.manual_seed(args.seed)
        tables = [
            torchrec.EmbeddingBagConfig(
                name=f"t_{key}",
                embedding_dim=16,
                num_embeddings=int(n),
                feature_names=[key],
                pooling=torchrec.PoolingType.SUM,
            )
            for key, n in zip(train.keys, train.num_embeddings_per_feature, strict=True)
        ]
        self.table_names = [t.name for t in tables]
        # On CPU with TorchRec's own init (EBC: U(+-sqrt(1/rows)), Linear: torch's default).
        model = DLRM(
            embedding_bag_collection=torchrec.EmbeddingBagCollection(tables),
            dense_in_features=max(int(train.num_dense), 1),
            dense_arch_layer_sizes=[64, 16],
            over_arch_layer_sizes=[64, 32, 1],
        )
        own = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        start = own if initial is None else initial
        fused = {
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": args.sparse_lr,
            "eps": EPS,
        }
        sharder = EmbeddingBagCollectionSharder(fused_params=fused)
        only = ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value],
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
        )
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=1, compute_device="cpu"),
            constraints={t: only for t in self.table_names},
        )
        plan = planner.collective_plan(model, [sharder], torch.distributed.GroupMember.WORLD)
        self.dmp = DistributedModelParallel(
            model,
            device=torch.device("cpu"),
            sharders=[sharder],
            plan=plan,
            data_parallel_wrapper=NoWrap(),
        )
        self._load(start)
        dense = [p for n, p in self.dmp.module.named_parameters() if not n.startswith(EBC)]
        self.dense_opt = torch.optim.Adam(dense, lr=args.dense_lr, betas=(0.9, 0.999), eps=1e-8)
        self.loss_fn = torch.nn.BCEWithLogitsLoss()

    def _tables(self) -> dict[str, object]:
        bags = self.dmp.module.sparse_arch.embedding_bag_collection.embedding_bags
        return {f"{EBC}.embedding_bags.{t}.weight": bags[t].weight for t in self.table_names}

    def _dense_params(self) -> dict[str, object]:
        return {n: p for n, p in self.dmp.module.named_parameters() if not n.startswith(EBC)}

    def _load(self, state: dict[str, np.ndarray]) -> None:
        torch = self.torch
        targets = {**self._tables(), **self._dense_params()}
        if set(targets) != set(state):
            raise ValueError(f"parameter names differ: {sorted(set(targets) ^ set(state))}")
        with torch.no_grad():
            for k, t in targets.items():
                t.copy_(torch.from_numpy(np.array(state[k], np.float32)).reshape(t.shape))

    def params(self) -> dict[str, np.ndarray]:
        targets = {**self._tables(), **self._dense_params()}
        return {k: t.detach().numpy().copy() for k, t in targets.items()}

    def inputs(self, batch):
        keys, values, lengths = kjt_arrays(batch.sparse_features)
        kjt = self.torchrec.KeyedJaggedTensor(
            keys=keys, values=self.torch.from_numpy(values), lengths=self.torch.from_numpy(lengths)
        )
        return self.torch.from_numpy(dense_input(batch)), kjt

    def train_step(self, batch) -> float:
        dense, kjt = self.inputs(batch)
        labels = self.torch.from_numpy(np.asarray(batch.labels, np.float32))
        logits = self.dmp(dense, kjt).squeeze(-1)
        loss = self.loss_fn(logits, labels)
        self.dense_opt.zero_grad()
        loss.backward()  # also applies the fused row-wise Adagrad to the touched rows
        self.dense_opt.step()
        return loss

    def train_epoch(self, data, epoch: int) -> tuple[int, float]:
        self.dmp.train()
        n, start = 0, time.perf_counter()
        for batch in train_batches(data, self.args, epoch):
            self.train_step(batch)
            n += self.args.batch_size
        return n, time.perf_counter() - start

    def logits(self, data) -> np.ndarray:
        self.dmp.eval()
        out = []
        with self.torch.no_grad():
            for batch in test_batches(data, self.args):
                out.append(self.dmp(*self.inputs(batch)).squeeze(-1).numpy())
        return np.concatenate(out)


def _process_group():
    """A world-size-1 gloo group for DMP; returns a closer (a no-op if one existed)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return lambda: None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.destroy_process_group


# ----- driver -----
def check(args, train) -> dict:
    """Both models from jaxrec's initial weights, ``--check-steps`` steps on the same
    batches: the largest parameter differences (tables, dense) and the first logits'."""
    jx = JaxrecRun(args, train)
    tr = TorchrecRun(args, train, jx.initial)
    batches = list(_take(train_batches(train, args, 0), args.check_steps + 1))
    first = batches[-1]
    dense, kjt = tr.inputs(first)
    with tr.torch.no_grad():
        t0 = tr.dmp(dense, kjt).squeeze(-1).numpy()
    j0 = np.asarray(jx.logits_step(jx.state, jax.device_put(first)))
    state, steps = jx.state, batches[:-1]
    for b in steps:
        state, _, _ = jx.step(state, jax.device_put(b))
        tr.train_step(b)
    jx.state = state
    ours, theirs = jx.params(), tr.params()
    tables = [k for k in ours if k.startswith(EBC)]
    diff = {k: float(np.max(np.abs(ours[k] - theirs[k].reshape(ours[k].shape)))) for k in ours}
    moved = max(float(np.max(np.abs(ours[k] - jx.initial[k]))) for k in tables)
    return {
        "bench": BENCH,
        "framework": "check",
        "steps": len(steps),
        "initial_logits_max_abs_diff": float(np.max(np.abs(t0 - j0))),
        "tables_max_abs_diff": max(diff[k] for k in tables),
        "tables_max_abs_change": moved,
        "dense_max_abs_diff": max(v for k, v in diff.items() if k not in tables),
    }


def _take(it: Iterator, n: int) -> Iterator:
    for _, x in zip(range(n), it, strict=False):
        yield x


def environment(args, frameworks) -> dict:
    env = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "jax_version": jax.__version__,
        "jaxrec_version": jaxrec.__version__,
    }
    if "torchrec" in frameworks:
        import torch
        import torchrec

        env |= {
            "torch_version": torch.__version__,
            "torchrec_version": getattr(torchrec, "__version__", "unknown"),
            "torch_threads": torch.get_num_threads(),
        }
    return env


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    argv = list(sys.argv[1:] if argv is None else argv)
    frameworks = [f for f in args.frameworks.split(",") if f]
    unknown = sorted(set(frameworks) - {"jaxrec", "torchrec"})
    if unknown:
        raise SystemExit(f"unknown frameworks {unknown}; choose from jaxrec, torchrec")
    emit = lambda rec: print(json.dumps(rec), flush=True)
    if "torchrec" in frameworks and not torchrec_available():
        emit({"bench": BENCH, "framework": "torchrec", "skipped": "torchrec is not importable"})
        frameworks.remove("torchrec")
    jobs = [*frameworks]
    if len(frameworks) == 2 and args.init == "jaxrec" and args.check_steps > 0:
        jobs.insert(0, "check")
    if args.init == "jaxrec" and frameworks == ["torchrec", "jaxrec"]:
        jobs = [j for j in jobs if j != "jaxrec"]
        jobs.insert(jobs.index("torchrec"), "jaxrec")  # jaxrec first: it writes the init
    final: dict[str, dict] = {}
    common: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init.npz")
        for job in jobs:
            # One process per framework: neither's thread pools or caches slow the other.
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", job]
            out = subprocess.run(
                [*cmd, "--init-file", init_file], stdout=subprocess.PIPE, text=True, check=True
            ).stdout
            for text in out.splitlines():
                rec = json.loads(text)
                emit(rec)
                if rec["framework"] in frameworks:
                    final[rec["framework"]] = rec
                    common = {k: rec[k] for k in COMMON}
    summary = {"bench": BENCH, "framework": "summary", "epochs": args.epochs, **common}
    for fw, rec in final.items():
        summary[f"{fw}_test_auc"] = rec["test_auc"]
        summary[f"{fw}_test_ne"] = rec["test_ne"]
    if len(final) == 2:
        diff = final["jaxrec"]["test_auc"] - final["torchrec"]["test_auc"]
        summary["auc_diff_jaxrec_minus_torchrec"] = 0.0 + round(diff, 5)
    emit({**summary, **environment(args, frameworks)})
    return 0


COMMON = ("dataset", "train_size", "test_size", "batch_size", "dense_lr", "sparse_lr", "seed")
COMMON += ("init",)


def worker(args: argparse.Namespace) -> int:
    """One job of :func:`main` in its own process: ``check``, ``jaxrec`` or ``torchrec``."""
    fw = args.worker
    if fw in ("check", "torchrec"):
        import torch

        torch.set_num_threads(args.threads)
    train, test = load(args)
    labels = test.labels()
    common = {
        "dataset": "synthetic_tiny" if args.synthetic_tiny else "movielens_100k",
        "train_size": len(train),
        "test_size": len(test),
        "batch_size": args.batch_size,
        "dense_lr": args.dense_lr,
        "sparse_lr": args.sparse_lr,
        "seed": args.seed,
        "init": args.init,
    }
    emit = lambda rec: print(json.dumps(rec), flush=True)
    close = _process_group() if fw in ("check", "torchrec") else (lambda: None)
    try:
        if fw == "check":
            emit(check(args, train))
            return 0
        if fw == "jaxrec":
            run = JaxrecRun(args, train)
            if args.init_file:
                np.savez(args.init_file, **run.initial)
        else:
            initial = None
            if args.init == "jaxrec":
                if args.init_file and os.path.exists(args.init_file):
                    with np.load(args.init_file) as f:
                        initial = dict(f)
                else:
                    initial = JaxrecRun(args, train).initial
            run = TorchrecRun(args, train, initial)
        for epoch in range(args.epochs):
            n, seconds = run.train_epoch(train, epoch)
            m = metrics(labels, run.logits(test))
            extra = {"job_evaluate_auc": round(run.job_auc(test), 5)} if fw == "jaxrec" else {}
            emit(line(fw, epoch + 1, m, n, seconds, **extra, **common))
    finally:
        close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
