"""Load test of the HTTP prediction server on loopback.

Starts :class:`jaxrec.inference.PredictionServer` in a thread over an exported
artifact (``--artifact``, or a small DLRM exported to a temporary directory),
then, for each ``--clients`` setting, sends ``--requests`` POST /predict
requests from that many client threads (each with its own keep-alive
connection), every request carrying ``--instances`` random instances. Prints
one JSON line per setting: requests/s,
instances/s and the p50/p99/max latency of a request as a client sees it
(JSON encoding, loopback HTTP, validation, padding to a power-of-two bucket,
the XLA call, the answer). More requests in flight than ``--max-queued``
get some ``503`` answers (``busy_503``, counted apart); ``errors`` counts
everything else that is not a 200, connection resets included, and makes the
exit status 1.

Warm-up requests (one per client, not timed) compile the bucket first. Client
and server share this process and its GIL, so on a few CPU cores the figures
are a floor, not what a separate client would measure.

Run from the repository root (``PYTHONPATH=.`` or jaxrec installed)::

    python bench/serve.py --requests 500 --clients 1,4 --instances 16 --T 8 --E 1000
    python bench/serve.py --artifact artifacts/dlrm --requests 2000 --clients 8
    python bench/serve.py --requests 2000 --clients 200 --workers 4 --max-queued 16  # burst
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from jaxrec.inference import ExportedModel, PredictionServer, load

BENCH = "serve"
MAX_REQUESTS = 100_000  # bounded: a load test, not a soak test
MAX_CLIENTS = 512


def tiny_artifact(path: Path, *, num_tables: int = 8, rows: int = 1000, dim: int = 16) -> Path:
    """A small DLRM (``num_tables`` features, 13 dense inputs) exported to ``path``."""
    from flax import nnx

    from jaxrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from jaxrec.inference import export
    from jaxrec.models import DLRM

    keys = [f"f{i}" for i in range(num_tables)]
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[k])
        for i, k in enumerate(keys)
    ]
    model = DLRM(
        EmbeddingBagCollection(tables, rngs=nnx.Rngs(0)),
        dense_in_features=13,
        dense_arch_layer_sizes=[32, dim],
        over_arch_layer_sizes=[32, 1],
        rngs=nnx.Rngs(1),
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys, np.zeros(0, np.int32), np.zeros(len(keys), np.int32), capacities=4
    )
    export(model, (np.zeros((1, 13), np.float32), kjt), path, max_ids_per_sample=4)
    return path


def make_instances(model: ExportedModel, n: int, rng: np.random.Generator) -> list[dict]:
    """``n`` valid random instances for ``model`` (ids within its limits)."""
    out = []
    for _ in range(n):
        sparse = {
            k: rng.integers(0, rows, rng.integers(0, cap + 1)).tolist()
            for k, cap, rows in zip(
                model.features, model.max_ids, model.num_embeddings, strict=True
            )
        }
        out.append({"dense": rng.standard_normal(model.num_dense).tolist(), "sparse": sparse})
    return out


def _client(
    server: PredictionServer, bodies: list[bytes], latencies: list, errors: list, busy: list
) -> None:
    """Sends ``bodies`` on one keep-alive connection (reopened when the server closes
    it); a 503 goes to ``busy``, any other failure (status or exception) to ``errors``."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    headers = {"Content-Type": "application/json"}
    try:
        for body in bodies:
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/predict", body=body, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
            except OSError as e:  # e.g. a connection reset: the failure this bench guards
                conn.close()
                errors.append(repr(e))
                continue
            latencies.append(time.perf_counter() - t0)
            if resp.status == 503:
                busy.append(payload)
            elif resp.status != 200:
                errors.append(f"{resp.status}: {payload[:200]!r}")
    finally:
        conn.close()


def run(
    model: ExportedModel,
    *,
    requests: int = 200,
    clients: int = 4,
    instances: int = 16,
    seed: int = 0,
    workers: int = 8,
    max_queued: int = 64,
) -> dict:
    """Serves ``model`` on loopback and times ``requests`` requests; returns the record."""
    if not 1 <= requests <= MAX_REQUESTS:
        raise ValueError(f"requests must be in [1, {MAX_REQUESTS}], got {requests}")
    if not 1 <= clients <= MAX_CLIENTS:
        raise ValueError(f"clients must be in [1, {MAX_CLIENTS}], got {clients}")
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    rng = np.random.default_rng(seed)
    pool = [json.dumps({"instances": make_instances(model, instances, rng)}).encode()]
    pool += [json.dumps({"instances": make_instances(model, instances, rng)}).encode()]
    per_client = [
        [pool[i % len(pool)] for i in range(c, requests, clients)] for c in range(clients)
    ]
    server = PredictionServer(
        model, port=0, max_instances=instances, max_workers=workers, max_queued=max_queued
    ).start()
    try:
        warm_lat: list[float] = []
        warm_err: list[str] = []
        _client(server, pool[:1], warm_lat, warm_err, warm_err)  # compiles the bucket
        if warm_err:
            raise RuntimeError(f"warm-up request failed: {warm_err[0]}")
        latencies: list[list[float]] = [[] for _ in range(clients)]
        errors: list[str] = []
        busy: list[bytes] = []
        threads = [
            threading.Thread(
                target=_client, args=(server, per_client[c], latencies[c], errors, busy)
            )
            for c in range(clients)
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    finally:
        server.stop()
    lat_ms = np.sort(np.concatenate([np.asarray(x, np.float64) for x in latencies])) * 1e3
    done = len(lat_ms)  # answered requests (200 or not)
    ok = done - len(busy)

    def ms(x):  # None when nothing was answered
        return round(float(x), 3) if done else None

    dev = jax.devices()[0]
    return {
        "bench": BENCH,
        "requests": done,
        "clients": clients,
        "instances_per_request": instances,
        "errors": len(errors),
        "busy_503": len(busy),
        "workers": workers,
        "max_queued": max_queued,
        "seconds": round(seconds, 4),
        "requests_per_s": round(done / seconds, 2),
        "instances_per_s": round(ok * instances / seconds, 1),
        "p50_ms": ms(done and np.percentile(lat_ms, 50)),
        "p99_ms": ms(done and np.percentile(lat_ms, 99)),
        "max_ms": ms(done and lat_ms[-1]),
        "mean_ms": ms(done and statistics.fmean(lat_ms.tolist())),
        "warmup_ms": round(warm_lat[0] * 1e3, 3),
        "compiled_batch_sizes": sorted(model.compiled_batch_sizes),
        "features": len(model.features),
        "num_dense": model.num_dense,
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "jax_version": jax.__version__,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", help="an exported artifact (default: a small DLRM)")
    p.add_argument("--requests", type=int, default=200, help=f"timed requests, <= {MAX_REQUESTS}")
    p.add_argument("--clients", default="1,4", help="client threads, comma-separated settings")
    p.add_argument("--instances", type=int, default=16, help="instances per request")
    p.add_argument("--T", type=int, default=8, help="default model: sparse features (tables)")
    p.add_argument("--E", type=int, default=1000, help="default model: rows per table")
    p.add_argument("--D", type=int, default=16, help="default model: embedding dim")
    p.add_argument("--workers", type=int, default=8, help="server decoding threads")
    p.add_argument("--max-queued", type=int, default=64, help="requests waiting (then 503)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    settings = [int(c) for c in str(args.clients).split(",") if c.strip()]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.artifact:
            path = Path(args.artifact)
        else:
            path = tiny_artifact(Path(tmp) / "dlrm", num_tables=args.T, rows=args.E, dim=args.D)
        model = load(path, max_batch_size=args.instances)
        for clients in settings:
            rec = run(
                model,
                requests=args.requests,
                clients=clients,
                instances=args.instances,
                seed=args.seed,
                workers=args.workers,
                max_queued=args.max_queued,
            )
            rec["artifact"] = args.artifact or f"tiny_dlrm(T={args.T},E={args.E},D={args.D})"
            print(json.dumps(rec), flush=True)
            failed += rec["errors"]
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
