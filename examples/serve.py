"""Serve an exported model over HTTP, or predict a JSONL file.

Export a trained run first (``python examples/export_dlrm.py RUN_DIR ARTIFACT``),
then either::

    python examples/serve.py ARTIFACT --port 8000
    curl -s localhost:8000/health
    curl -s -XPOST localhost:8000/predict -d '{"instances": [{"dense": [...],
        "sparse": {"cat_0": [3], ...}}]}'

or, file in / file out (one instance per line, one result per line)::

    python examples/serve.py ARTIFACT --input requests.jsonl --output preds.jsonl

The request schema and error codes are in ``jaxrec/inference/serving.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from jaxrec.inference import PredictionServer, load, predict_file


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("artifact", help="directory written by jaxrec.inference.export")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="0: any free port")
    p.add_argument("--max-instances", type=int, default=256, help="per request")
    p.add_argument("--workers", type=int, default=4, help="threads decoding request bodies")
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=256,
        help="instances of queued requests per model call",
    )
    p.add_argument(
        "--batch-timeout-ms", type=float, default=0.0, help="wait this long for a fuller batch"
    )
    p.add_argument(
        "--max-queued", type=int, default=1024, help="requests waiting for the model (then 503)"
    )
    p.add_argument("--max-connections", type=int, default=1024, help="open at once (then 503)")
    p.add_argument("--idle-timeout", type=float, default=5.0, help="seconds; then closed")
    p.add_argument("--input", help="batch mode: requests.jsonl, one instance per line")
    p.add_argument("--output", help="batch mode: where predictions go (JSON lines)")
    p.add_argument("--batch-size", type=int, default=64, help="batch mode: lines per call")
    p.add_argument("--verbose", action="store_true", help="log every request")
    args = p.parse_args(argv)
    if (args.input is None) != (args.output is None):
        p.error("--input and --output go together")
    largest = max(args.max_instances, args.batch_size, args.max_batch_size)
    model = load(args.artifact, max_batch_size=largest)
    if args.input:
        stats = predict_file(model, args.input, args.output, batch_size=args.batch_size)
        print(json.dumps(stats), flush=True)
        return 0 if stats["errors"] == 0 else 1
    server = PredictionServer(
        model,
        args.host,
        args.port,
        max_instances=args.max_instances,
        max_batch_size=args.max_batch_size,
        batch_timeout_ms=args.batch_timeout_ms,
        max_workers=args.workers,
        max_queued=args.max_queued,
        max_connections=args.max_connections,
        idle_timeout=args.idle_timeout,
        quiet=not args.verbose,
    )
    print(f"serving {args.artifact} at {server.url} (POST /predict, GET /health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
