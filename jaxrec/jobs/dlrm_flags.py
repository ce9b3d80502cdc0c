"""The flags of ``jaxrec-train-dlrm`` (see :mod:`jaxrec.jobs.train_dlrm`)."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import NoReturn

from .dlrm_config import DlrmJobConfig

DESCRIPTION = "The main job: train DLRM (or DLRM-DCN) on click data, evaluate, checkpoint, resume."

SHARDINGS = ("planner", "table_wise", "row_wise", "column_wise", "data_parallel")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except the ``None`` and ``False`` that mean "not given"
    (the hook ArgumentDefaultsHelpFormatter itself overrides)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:  # not 0: "in" would match it
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Says what is wrong in one line and where to look in a second, instead of
    argparse's whole usage block (which buries the line that matters)."""

    def error(self, message: str) -> NoReturn:
        unknown = "unrecognized arguments: "
        if message.startswith(unknown):  # name the flag the user may have meant
            flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            for arg in message[len(unknown) :].split():
                close = difflib.get_close_matches(arg.split("=")[0], flags, n=1)
                if close:
                    message += f" (did you mean {close[0]}?)"
                    break
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: see --help for every flag\n")


def parse_config(argv: Sequence[str] | None = None) -> DlrmJobConfig:
    """The job's flags from ``argv`` (default: the command line) as the record its
    parts take; exits as :func:`parse_args` does."""
    return DlrmJobConfig.from_args(parse_args(argv))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The job's flags from ``argv`` (default: the command line). ``--help`` and a bad
    flag exit here; this module imports nothing heavy, so both answer at once."""
    p = _Parser(
        prog="jaxrec-train-dlrm",
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    data = p.add_argument_group("data")
    data.add_argument(
        "--dataset",
        default="synthetic",
        choices=("synthetic", "criteo", "movielens"),
        help="synthetic: Criteo-like with a planted model; criteo: --data-dir needed; "
        "movielens: ml-100k, fetched once (or --data-dir)",
    )
    data.add_argument(
        "--data-dir", help="criteo: TSV day files or npy files; movielens: the folder"
    )
    data.add_argument("--num-train", type=int, default=300_000, help="synthetic: train samples")
    data.add_argument("--num-eval", type=int, default=50_000, help="synthetic: eval samples")
    data.add_argument(
        "--num-embeddings", type=int, default=100_000, help="criteo: rows per table (modulo)"
    )
    data.add_argument(
        "--multi-hot",
        help="criteo/synthetic: expand each id into a bag of N ids, or 'mlperf' (DLRM-DCNv2 sizes)",
    )
    data.add_argument("--skip-malformed", action="store_true", help="criteo TSV: skip bad lines")
    model = p.add_argument_group("model")
    model.add_argument("--model", default="dlrm", choices=("dlrm", "dcn"), help="DLRM or DLRM-DCN")
    model.add_argument("--embedding-dim", type=int, default=16, help="every table's width")
    model.add_argument("--dense-arch", default="64,16", help="layer sizes; the last = emb dim")
    model.add_argument("--over-arch", default="64,32,1", help="layer sizes; the last = 1")
    model.add_argument("--dcn-layers", type=int, default=2, help="dcn: cross layers")
    model.add_argument("--dcn-rank", type=int, default=16, help="dcn: low-rank dim")
    train = p.add_argument_group("training")
    train.add_argument(
        "--batch-size",
        type=int,
        default=1024,
        help="samples PER DEVICE: a step trains on --batch-size x --devices samples "
        "(divide it by N with --devices N to keep the global batch, and the AUC)",
    )
    train.add_argument("--epochs", type=int, default=1, help="passes over the training set")
    train.add_argument("--max-steps", type=int, help="stop after this many steps")
    train.add_argument("--dense-lr", type=float, default=1e-3, help="Adam, for the MLPs")
    train.add_argument(
        "--sparse-lr", type=float, default=0.05, help="fused row-wise Adagrad, for the tables"
    )
    train.add_argument("--seed", type=int, default=0, help="data, initialisation, shuffling")
    train.add_argument("--eval-every", type=int, default=0, help="steps; 0: after each epoch")
    train.add_argument(
        "--pipeline",
        default="sync",
        choices=("sync", "sparse-dist", "semi-sync"),
        help="train pipeline: sync (TrainPipeline), sparse-dist (ids sent a step ahead), "
        "semi-sync (embeddings looked up a step ahead: their updates land one step late)",
    )
    train.add_argument(
        "--grad-accumulation",
        type=int,
        default=1,
        metavar="K",
        help="micro-batches per optimizer step (make_accumulating_train_step): each step "
        "trains K batches of --batch-size per device and applies one update, as one step on "
        "their concatenation would (sync pipeline; no cached or dynamic tables)",
    )
    dist = p.add_argument_group("devices")
    dist.add_argument(
        "--devices",
        type=int,
        default=1,
        help="shard tables over N devices (all processes together; several processes: "
        "default every device)",
    )
    dist.add_argument(
        "--sharding", default="planner", choices=SHARDINGS, help="planner: the planner's plan"
    )
    dist.add_argument(
        "--qcomms",
        default="fp32",
        choices=("fp32", "fp16", "bf16"),
        help="precision of the embedding payloads between devices (TorchRec's QComms)",
    )
    host = p.add_argument_group(
        "host memory (TorchRec's fused_uvm_caching: a table in host memory, a device cache "
        "of its rows)"
    )
    host.add_argument(
        "--hbm-gib",
        type=float,
        help="planner: device memory per device in GiB (default: what the devices report); "
        "tables that do not fit are kept in host memory with a device cache",
    )
    host.add_argument(
        "--cache-tables",
        help="tables always kept in host memory with a device cache: comma-separated "
        "names (t_<feature>, e.g. t_cat_0) or 'all'",
    )
    host.add_argument(
        "--cache-load-factor",
        type=float,
        default=0.2,
        help="the device cache's share of a cached table's rows (TorchRec's default)",
    )
    host.add_argument(
        "--cache-algorithm",
        default="lru",
        choices=("lru", "lfu"),
        help="which cached row a miss replaces",
    )
    host.add_argument(
        "--cache-slot-maps",
        default=None,
        choices=("device", "host"),
        help="where the caches' slot maps live and batches are planned: device "
        "(set-associative, one program per batch; the default with one process on GPUs) "
        "or host (fully associative; the default on a CPU, and the only choice with "
        "several processes)",
    )
    host.add_argument(
        "--cache-scale-up",
        action="store_true",
        help="planner: give the device memory its plan leaves free to the caches (larger "
        "load factors, or tables whole on the devices)",
    )
    host.add_argument(
        "--cache-statistics-batches",
        type=int,
        default=0,
        help="planner: price caching with each table's miss rates measured on the first N "
        "training steps (this cache's policy, from cold); 0: as if ids were uniform",
    )
    dyn = p.add_argument_group(
        "dynamic tables (rows keyed by the raw id: admission and eviction; see "
        "docs/guides/dynamic-tables.md)"
    )
    dyn.add_argument(
        "--dynamic-tables",
        type=int,
        default=0,
        metavar="SLOTS",
        help="make every table a dynamic table of SLOTS rows keyed by the raw id (0: off); "
        "sharded row-wise by the id's hash",
    )
    dyn.add_argument("--dynamic-ways", type=int, default=16, help="slots per hash bucket")
    dyn.add_argument(
        "--dynamic-eviction", default="lru", choices=("lru", "lfu", "ttl"), help="when full"
    )
    dyn.add_argument(
        "--dynamic-ttl", type=int, default=1000, help="ttl: training steps an unused id lives"
    )
    dyn.add_argument(
        "--dynamic-admission",
        type=int,
        default=1,
        metavar="N",
        help="an id gets a row on its N-th sighting (1: at once)",
    )
    procs = p.add_argument_group("processes (multi-host; see jaxrec.distributed.initialize)")
    procs.add_argument(
        "--distributed",
        default="env",
        choices=("env", "auto", "off"),
        help="env: several processes when the flags below or a launcher (srun, mpirun) say so; "
        "auto: always let JAX detect the cluster; off: one process",
    )
    procs.add_argument("--coordinator-address", help="host:port of process 0")
    procs.add_argument("--num-processes", type=int, help="processes in the job")
    procs.add_argument("--process-id", type=int, help="this process, 0 .. num-processes - 1")
    procs.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=60,
        help="seconds: a process silent this long counts as dead and every other one stops "
        "(a peer blocked in a collective with it stops at once)",
    )
    out = p.add_argument_group("outputs")
    out.add_argument(
        "--run-dir",
        help="where the run writes; default: a new runs/dlrm-<date>-<time> per run "
        "(needed with --resume and with several processes)",
    )
    out.add_argument(
        "--overwrite",
        action="store_true",
        help="start --run-dir again, removing an earlier run's checkpoints and reports",
    )
    out.add_argument(
        "--resume", action="store_true", help="continue --run-dir from its newest intact checkpoint"
    )
    out.add_argument("--checkpoint-every", type=int, default=0, help="steps; 0: at the end only")
    out.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept")
    out.add_argument("--no-checkpoint", action="store_true", help="write no checkpoint")
    out.add_argument(
        "--tensorboard", action="store_true", help="write TensorBoard scalars (tensorboardX)"
    )
    out.add_argument("--plot", action="store_true", help="write curves.png (matplotlib)")
    out.add_argument("--quiet", action="store_true", help="print only the summary line")
    return p.parse_args(argv)
