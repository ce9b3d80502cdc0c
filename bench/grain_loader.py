"""Grain (``grain``, the JAX ecosystem's loader) against jaxrec's batch iterator, on the job's data.

The data is the job's default: synthetic Criteo-like rows (26 one-id sparse
features, 13 dense), batch 1024, shuffled per epoch. Loaders:

* ``jaxrec``: ``TableDataset.batches`` (what the job reads through
  ``jaxrec/jobs/shards.py``): one permutation, then one vectorised gather per
  batch straight into a ``Batch`` with a ``KeyedJaggedTensor``.
* ``grain_rows``: Grain's own idiom: a ``grain.MapDataset`` of rows (a
  random-access source, one record per sample), shuffled and batched by
  Grain; ``batch_fn`` stacks the records into the same ``Batch``.
* ``grain_batches``: Grain as the scheduler only: a ``MapDataset`` over batch
  numbers whose ``map`` builds each batch with jaxrec's vectorised gather
  (``TableDataset._batch``, the step ``batches`` runs), iterated with Grain's
  thread prefetch (``ReadOptions``).

Two figures per loader, medians of ``--reps`` (the loaders take turns in each
rep, so a busy machine slows them alike; the 1-minute load average is
recorded): the data path alone (samples/s of iterating one epoch of batches,
nothing else) and the job end to end
(``jaxrec-train-dlrm --no-checkpoint``, with the job's batch source replaced;
its ``samples_per_s``, which times the training loop and not the evaluation).
Prints, and appends to ``--out``, one JSON line per loader and figure, the CPU
named in each.

Run from the repository root (about 3 minutes on two cores)::

    python bench/grain_loader.py --out bench/results/grain_loader_cpu_2core_<date>.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grain
import numpy as np
from common import cpu_model

from jaxrec.datasets import Batch, synthetic_criteo_split
from jaxrec.jobs import train_dlrm
from jaxrec.sparse import KeyedJaggedTensor


class Rows:
    """One record per sample (Grain's random-access source protocol)."""

    def __init__(self, data):
        (table,) = data.tables  # the synthetic set: one in-memory table, one id per feature
        self.dense, self.labels = np.asarray(table.dense), np.asarray(table.labels)
        self.ids = np.stack([np.asarray(c) for c in table.sparse], axis=1)  # [N, 26]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.dense[i], self.labels[i], self.ids[i]


def collate(keys, capacities):
    def batch_fn(records) -> Batch:
        dense, labels, ids = (np.stack(x) for x in zip(*records, strict=True))
        values = ids.T.reshape(-1).astype(np.int64)  # key-major, as a KJT holds them
        lengths = np.ones(values.shape, np.int64)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys, values, lengths, stride=len(labels), capacities=capacities, on_host=True
        )
        return Batch(dense.astype(np.float32), kjt, labels.astype(np.float32).reshape(-1))

    return batch_fn


def grain_rows(data, batch_size: int, *, seed: int, epoch: int, threads: int) -> Iterator[Batch]:
    ds = grain.MapDataset.source(Rows(data)).shuffle(seed=seed + 1000 * epoch)
    fn = collate(data.keys, list(data.capacities(batch_size)))
    ds = ds.batch(batch_size, drop_remainder=True, batch_fn=fn)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4)))


def grain_batches(data, batch_size: int, *, seed: int, epoch: int, threads: int) -> Iterator[Batch]:
    rows = np.random.default_rng([seed, epoch, 0]).permutation(data.num_rows)
    caps = list(data.capacities(batch_size))
    ds = grain.MapDataset.range(data.num_rows // batch_size).map(
        lambda s: data._batch(rows[s * batch_size : (s + 1) * batch_size], caps, "raise")
    )
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4)))


def jaxrec_batches(data, batch_size: int, *, seed: int, epoch: int, threads: int):
    return data.batches(batch_size, shuffle=True, seed=seed, epoch=epoch)


LOADERS = {"jaxrec": jaxrec_batches, "grain_rows": grain_rows, "grain_batches": grain_batches}


def data_path(loader, data, batch_size: int, threads: int, epoch: int) -> float:
    """samples/s of iterating one epoch of batches."""
    t0, n = time.perf_counter(), 0
    for b in loader(data, batch_size, seed=0, epoch=epoch, threads=threads):
        n += len(b.labels)
    return n / (time.perf_counter() - t0)


def end_to_end(loader, argv: list[str], threads: int) -> float:
    """The job's samples_per_s with ``loader`` as its batch source (one device)."""

    def device_batches(data, args, epoch, ranks, world, skip):
        assert world == 1 and skip == 0, "one device, from the start"
        return loader(data, args.batch_size, seed=args.seed, epoch=epoch, threads=threads)

    real = train_dlrm._device_batches
    train_dlrm._device_batches = device_batches
    try:
        with tempfile.TemporaryDirectory() as run, contextlib.redirect_stdout(io.StringIO()):
            train_dlrm.main([*argv, "--run-dir", os.path.join(run, "r")])
            return json.loads(Path(run, "r", "summary.json").read_text())["samples_per_s"]
    finally:
        train_dlrm._device_batches = real


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--num-train", type=int, default=300_000, help="the job's default")
    p.add_argument("--batch-size", type=int, default=1024, help="the job's default")
    p.add_argument("--threads", type=int, default=2, help="Grain's reader threads")
    p.add_argument("--reps", type=int, default=3, help="medians over this many")
    p.add_argument("--loaders", default=",".join(LOADERS), help="comma-separated")
    p.add_argument("--out", help="append the JSON lines here too")
    args = p.parse_args()
    train, _ = synthetic_criteo_split(num_train=args.num_train, num_eval=1000, seed=0)
    job = ["--num-train", str(args.num_train), "--num-eval", "1000", "--quiet", "--no-checkpoint"]
    job += ["--batch-size", str(args.batch_size)]
    common = {
        "bench": "grain_loader",
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "grain_version": importlib.metadata.version("grain"),
        "num_train": args.num_train,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "reps": args.reps,
    }
    names = args.loaders.split(",")
    rates = {(name, what): [] for name in names for what in ("data_path", "end_to_end")}
    loads = []
    for rep in range(args.reps):  # loaders interleaved: each rep sees the same machine load
        for name in names:
            loader = LOADERS[name]
            rates[name, "data_path"].append(
                data_path(loader, train, args.batch_size, args.threads, rep)
            )
            rates[name, "end_to_end"].append(end_to_end(loader, job, args.threads))
            loads.append(os.getloadavg()[0])
    common["load_avg_1m"] = [min(loads), max(loads)]  # the 2 cores are shared: say how busy
    for (name, what), got in rates.items():
        rec = {
            **common,
            "loader": name,
            "measure": what,
            "median_samples_per_s": round(statistics.median(got)),
            "samples_per_s": [round(r) for r in got],
        }
        line = json.dumps(rec)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
