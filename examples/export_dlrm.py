"""Export a trained ``jaxrec-train-dlrm`` run as a ``jax.export`` artifact.

::

    python examples/train_dlrm.py --run-dir runs/dlrm --num-train 20000 --max-steps 50
    python examples/export_dlrm.py runs/dlrm artifacts/dlrm
    python examples/serve.py artifacts/dlrm

The artifact predicts click probabilities (``sigmoid(logits)``, one number per
sample) from dense features and per-feature id lists; see
``jaxrec/inference/export.py`` for its layout.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxrec import inference
from jaxrec.jobs.dlrm_flags import parse_config
from jaxrec.jobs.dlrm_parts import load_data
from jaxrec.jobs.from_run import click_probability, model_from_run
from jaxrec.metrics import roc_auc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("run_dir", help="the --run-dir of a train_dlrm run (with checkpoints)")
    p.add_argument("artifact", help="output directory")
    p.add_argument("--step", type=int, help="checkpoint step; None: the latest")
    p.add_argument("--platforms", default="cpu", help="comma-separated, e.g. cpu,cuda")
    p.add_argument("--max-ids", type=int, help="ids per sample and feature; None: the run's data")
    p.add_argument(
        "--quantize",
        default="none",
        choices=("none", "int8", "int4", "fp16", "bf16"),
        help="row-wise quantize the tables first (jaxrec.inference.quantize_inference_model)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing artifact")
    p.add_argument(
        "--eval", action="store_true", help="AUC of the loaded artifact on the run's eval set"
    )
    args = p.parse_args(argv)
    model, example = model_from_run(args.run_dir, step=args.step)
    if args.quantize != "none":  # hook: the quantized collections of jaxrec.inference
        quantize = getattr(inference, "quantize_inference_model", None)
        if quantize is None:
            raise SystemExit("--quantize needs jaxrec.inference.quantize_inference_model")
        model = quantize(model, dtype=args.quantize, implementation="xla")
    manifest = inference.export(
        model,
        example,
        args.artifact,
        max_ids_per_sample=args.max_ids,
        apply_fn=click_probability,
        platforms=tuple(args.platforms.split(",")),
        output_name="click_probability",
        overwrite=args.overwrite,
    )
    shown = {k: manifest[k] for k in ("features", "num_dense", "platforms", "jax_version")}
    if args.eval:
        shown["eval_auc"] = eval_auc(args.run_dir, args.artifact)
    print(json.dumps({"artifact": args.artifact, "quantize": args.quantize, **shown}), flush=True)
    return 0


def eval_auc(run_dir: str, artifact: str) -> float:
    """The artifact's AUC on the run's eval set, through ``load`` (as a server runs it)."""
    saved = json.loads((Path(run_dir) / "args.json").read_text())["args"]
    _, data = load_data(parse_config([]).replace_known(saved))
    predict = inference.load(artifact)
    probs, labels = [], []
    for b in data.batches(1024, shuffle=False, drop_last=False):
        probs.append(np.asarray(predict(b.dense_features, b.sparse_features)).reshape(-1))
        labels.append(np.asarray(b.labels))
    return round(roc_auc(np.concatenate(labels), np.concatenate(probs)), 5)


if __name__ == "__main__":
    sys.exit(main())
