"""The main job: train DLRM (or DLRM-DCN), evaluate AUC/NE, checkpoint, resume.

A thin wrapper around ``jaxrec.jobs.dlrm_cli`` (also installed as the
``jaxrec-train-dlrm`` command); every flag is documented by ``--help``. Steps
with a non-finite loss or gradient are skipped and counted (``skipped_steps``
in the summary).

    python examples/train_dlrm.py                        # synthetic Criteo-like, ~15 s
    python examples/train_dlrm.py --devices 8            # tables sharded over 8 CPU devices
    python examples/train_dlrm.py --dataset movielens --epochs 3 --batch-size 256 \\
        --sparse-lr 0.02                                 # real ml-100k (fetched once)
    python examples/train_dlrm.py --run-dir runs/a --max-steps 100   # a named run ...
    python examples/train_dlrm.py --run-dir runs/a --resume          # ... continued

Each run without ``--run-dir`` writes a new ``runs/dlrm-<date>-<time>``.
"""

from jaxrec.jobs.dlrm_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
