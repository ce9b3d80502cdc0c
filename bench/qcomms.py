"""QComms' effect on training: the DLRM job over 8 devices with fp32, fp16 and bf16 payloads.

Trains ``jaxrec-train-dlrm`` (synthetic Criteo-like data with a planted signal, the
same seed, data and plan for every precision) with the embedding payloads between
devices (pooled blocks forward, their gradients backward) in each precision, and
prints one JSON line per precision: the final evaluation (AUC, NE, log loss), its
difference from fp32, the training loss and time. The bytes side of QComms is
``bench/sharded.py --qcomms fp16`` (compiled collectives per sharding type).

    python bench/qcomms.py                          # 8 CPU devices, row-wise tables
    python bench/qcomms.py --num-train 50000 --epochs 1 --sharding table_wise
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from common import cpu_model, emit  # noqa: E402

from jaxrec.jobs import train_dlrm  # noqa: E402

PRECISIONS = ("fp32", "fp16", "bf16")


def run(precision: str, args: argparse.Namespace, root: Path) -> dict:
    run_dir = root / precision
    argv = [
        "--devices",
        "8",
        "--sharding",
        args.sharding,
        "--qcomms",
        precision,
        "--num-train",
        str(args.num_train),
        "--num-eval",
        str(args.num_eval),
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--embedding-dim",
        "16",
        "--seed",
        str(args.seed),
        "--run-dir",
        str(run_dir),
        "--no-checkpoint",
        "--quiet",
    ]
    if args.multi_hot:
        argv += ["--multi-hot", args.multi_hot]
    with contextlib.redirect_stdout(io.StringIO()):  # the job prints its summary too
        train_dlrm.main(argv)
    return json.loads((run_dir / "summary.json").read_text())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--sharding", default="row_wise", help="a jaxrec-train-dlrm --sharding")
    p.add_argument("--num-train", type=int, default=200_000)
    p.add_argument("--num-eval", type=int, default=50_000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=512, help="per device")
    p.add_argument("--multi-hot", default="8", help="ids per bag (--multi-hot of the job)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions.split(","):
            summary = run(precision, args, Path(tmp))
            ev = summary.get("eval", {})
            rec = {
                "bench": "qcomms_training",
                "qcomms": precision,
                "sharding": summary["sharding"],
                "devices": summary["devices"],
                "steps": summary["steps"],
                "samples": summary["samples"],
                "train_seconds": summary["train_seconds"],
                "eval": ev,
                "machine": cpu_model(),
                "jax_version": jax.__version__,
                "date": datetime.date.today().isoformat(),
            }
            if base is None:
                base = ev
            rec["eval_minus_fp32"] = {
                k: round(v - base[k], 6)
                for k, v in ev.items()
                if isinstance(v, int | float) and isinstance(base.get(k), int | float)
            }
            emit(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
