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

from jaxrec import inference


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="the --run-dir of a train_dlrm run (with checkpoints)")
    p.add_argument("artifact", help="output directory")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--platforms", default="cpu", help="comma-separated, e.g. cpu,cuda")
    p.add_argument(
        "--max-ids", type=int, help="ids per sample and feature (default: the run's data)"
    )
    p.add_argument(
        "--quantize",
        default="none",
        choices=("none", "int8", "int4", "fp16"),
        help="row-wise quantize the tables first (jaxrec.inference.quantize_inference_model)",
    )
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    model, example = inference.model_from_run(args.run_dir, step=args.step)
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
        apply_fn=inference.click_probability,
        platforms=tuple(args.platforms.split(",")),
        output_name="click_probability",
        overwrite=args.overwrite,
    )
    shown = {k: manifest[k] for k in ("features", "num_dense", "platforms", "jax_version")}
    print(json.dumps({"artifact": args.artifact, **shown}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
