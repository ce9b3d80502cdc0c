"""``jaxrec-train-dlrm``'s entry point: the flags first, then the job.

The flags are parsed before anything heavy loads (``dlrm_flags`` imports only
argparse, and ``import jaxrec`` is lazy), so ``--help`` and a mistyped flag
answer in a fraction of a second. Then the process restarts itself with huge
pages (:mod:`jaxrec.cpu.hugepages`, which imports no JAX either) and only the
restarted process imports the job: JAX, Flax and jaxrec load once.
"""

from __future__ import annotations

from collections.abc import Sequence

from .dlrm_flags import parse_config


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``jaxrec-train-dlrm`` on ``argv`` (default: the command line, which is
    restarted with huge pages once its flags parse)."""
    config = parse_config(argv)  # --help and bad flags exit here, before JAX loads
    if argv is None:
        # Imported here, not above: the job's modules load JAX, Flax and jaxrec.
        from ..cpu.hugepages import restart_with_huge_pages

        restart_with_huge_pages()
    from .train_dlrm import run

    return run(config)


if __name__ == "__main__":
    raise SystemExit(main())
