"""Managed-collision benchmark: remap + pooled lookup vs plain modulo hashing.

For a ``LookupSpec`` (``T`` tables of ``E`` rows, batch ``B``, ``L`` ids a
bag, Zipf ``alpha``), raw ids are drawn from a universe ``--universe-factor``
times larger than a table and scattered over ``[0, 2**31)``; each batch's
window of the universe drifts by ``--drift`` ranks, so a training run keeps
admitting and evicting ids. Implementations, each a jitted function timed on
a cycle of pre-built batches:

* ``modulo``: ``row = raw_id % E`` then the EBC lookup (the baseline: no
  state, collisions);
* ``mc_remap``: managed-collision remap in eval mode (binary search of the
  sorted slot table, no state change) then the lookup;
* ``mc_train``: the training forward of ``ManagedCollisionEmbeddingBagCollection``
  (record the ids, evict/admit every ``--interval`` calls and reset the
  evicted rows, remap, look up), state donated; timings are per call, so
  the median is a non-evicting call and ``mean_ms`` amortises evictions;
* ``remap_only``: the eval remap alone (no lookup).

The MC tables are warmed with training calls first (full tables, as in a
long run). Each record has ``ids_per_s`` and ``collision_free_rate``: the
share of ids that own their row (MC: ids admitted to a slot, measured in eval
on the benchmark's cycle of batches after the timed calls; modulo: ids whose
row no other distinct id of the same batch and key hits). A ``ratio`` line per MC
implementation gives its time over modulo's. The run exits 1 when the eval
MC output differs from the lookup of the separately remapped rows.

Run from the repository root (``PYTHONPATH=.`` or jaxrec installed)::

    python bench/mc.py --preset tiny
    python bench/mc.py --preset small --alpha 1.1 --reps 20
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from common import add_spec_args, add_timing_args, build_jaxrec, record, specs_from_args, time_ms  # noqa: E402
from flax import nnx
from specs import LookupSpec, zipf_ids  # noqa: E402

from jaxrec import KeyedJaggedTensor
from jaxrec.modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
)

BENCH = "mc"
IMPLS = ("modulo", "mc_remap", "mc_train", "remap_only")
POLICIES = {
    "lfu": LFU_EvictionPolicy,
    "lru": LRU_EvictionPolicy,
    "distance_lfu": DistanceLFU_EvictionPolicy,
}


def raw_batches(spec: LookupSpec, n: int, factor: int, drift: int, seed: int) -> list:
    """``n`` KJTs of raw int32 ids (``[0, 2**31)``), key-major, capacity ``B * L`` per key."""
    rng = np.random.default_rng(seed)
    universe = factor * spec.E
    size = spec.T * spec.B * spec.L
    out = []
    for i in range(n):
        if spec.alpha == 0:
            rank = rng.integers(0, universe, size)
        else:
            rank = zipf_ids(rng, universe, spec.alpha, size)
        index = (rank + i * drift) % (universe + n * drift)
        raw = ((index.astype(np.uint64) * 2654435761) % (1 << 31)).astype(np.int32)
        out.append(
            KeyedJaggedTensor(
                [f"f{t}" for t in range(spec.T)],
                raw,
                lengths=np.full(spec.T * spec.B, spec.L, np.int32),
                capacities=[spec.B * spec.L] * spec.T,
            )
        )
    return out


def build_mc(spec: LookupSpec, policy: str, interval: int, seed: int):
    ebc = build_jaxrec(spec, seed=seed)
    modules = {
        t.name: MCHManagedCollisionModule(
            spec.E, eviction_policy=POLICIES[policy](), eviction_interval=interval
        )
        for t in ebc.embedding_bag_configs()
    }
    mcc = ManagedCollisionCollection(modules, ebc.embedding_bag_configs())
    return ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=True)


def modulo_free_rate(kjt: KeyedJaggedTensor, E: int) -> float:
    """Share of ids whose row ``id % E`` no other distinct id of the same key hits."""
    values, free = np.asarray(kjt.values()), 0
    starts = np.asarray(kjt.capacity_offsets())
    for i in range(len(kjt.keys())):
        ids = values[starts[i] : starts[i + 1]]
        uniq = np.unique(ids)
        per_row = np.bincount(uniq % E, minlength=E)
        free += int(np.sum(per_row[ids % E] == 1))
    return free / values.size


def run(
    spec: LookupSpec,
    impls: Sequence[str] = IMPLS,
    *,
    reps: int = 20,
    warmup: int = 3,
    seed: int = 0,
    policy: str = "lru",
    interval: int = 5,
    universe_factor: int = 4,
    drift: int | None = None,
) -> list[dict]:
    """Benchmarks ``spec`` with each implementation; returns the JSON records (also printed)."""
    bad = sorted(set(impls) - set(IMPLS))
    if bad:
        raise ValueError(f"unknown impls {bad}; choose from {IMPLS}")
    drift = max(spec.E // 100, 1) if drift is None else drift
    nb = max(2 * interval, 8)
    data = raw_batches(spec, nb, universe_factor, drift, seed)
    mc = build_mc(spec, policy, interval, seed)
    mc.ensure_buffers(data[0])
    graphdef, state = nnx.split(mc)

    @functools.partial(jax.jit, static_argnums=2, donate_argnums=0)
    def train_fwd(state, kjt, with_rows: bool):
        m = nnx.merge(graphdef, state)
        out, remapped = m(kjt, deterministic=False)
        rows = remapped.values() if with_rows else None
        return nnx.state(m), out.values(), rows

    @jax.jit
    def eval_fwd(state, kjt):
        out, remapped = nnx.merge(graphdef, state)(kjt, deterministic=True)
        return out.values(), remapped.values()

    @jax.jit
    def remap_only(state, kjt):
        m = nnx.merge(graphdef, state)
        return m.managed_collision_collection(kjt, deterministic=True).values()

    ebc_graph, ebc_state = nnx.split(mc.embedding_bag_collection)
    ebc_state = jax.tree.map(jnp.copy, ebc_state)  # its own buffers: train_fwd donates state

    @functools.partial(jax.jit, static_argnums=2)
    def modulo_fwd(ebc_state, kjt, E: int):
        rows = KeyedJaggedTensor.tree_unflatten(
            (tuple(kjt.keys()), kjt.capacity_per_key(), kjt.stride()),
            (kjt.values() % E, kjt.lengths(), None),
        )
        return nnx.merge(ebc_graph, ebc_state)(rows).values()

    for i in range(3 * nb):  # warm the slot tables (training calls)
        state, _, _ = train_fwd(state, data[i % nb], False)
    jax.block_until_ready(state)

    cycle = {"i": 0}

    def next_batch():
        cycle["i"] = (cycle["i"] + 1) % nb
        return data[cycle["i"]]

    holder = {"state": state}

    def train_call():
        holder["state"], out, _ = train_fwd(holder["state"], next_batch(), False)
        out.block_until_ready()

    calls = {
        "modulo": lambda: modulo_fwd(ebc_state, next_batch(), spec.E).block_until_ready(),
        "mc_remap": lambda: eval_fwd(holder["state"], next_batch())[0].block_until_ready(),
        "mc_train": train_call,
        "remap_only": lambda: remap_only(holder["state"], next_batch()).block_until_ready(),
    }
    ids = spec.T * spec.B * spec.L
    miss = spec.E - 1
    records, agree = [], True
    for impl in impls:
        times = time_ms(calls[impl], reps, warmup)
        if impl == "modulo":
            free = statistics.mean(modulo_free_rate(k, spec.E) for k in data)
        else:
            rows = [np.asarray(eval_fwd(holder["state"], k)[1]) for k in data]
            free = statistics.mean(float(np.mean(r != miss)) for r in rows)
        extra = {}
        if impl == "mc_remap":  # the MC forward equals the lookup of the remapped rows
            out, rows = eval_fwd(holder["state"], data[0])
            rows_kjt = KeyedJaggedTensor.tree_unflatten(
                (tuple(data[0].keys()), data[0].capacity_per_key(), data[0].stride()),
                (rows, data[0].lengths(), None),
            )
            ebc_now = nnx.merge(graphdef, holder["state"]).embedding_bag_collection
            want = jax.jit(lambda e, k: e(k).values())(ebc_now, rows_kjt)
            diff = float(jnp.max(jnp.abs(out - want)))
            extra = {"max_abs_diff": diff, "outputs_agree": diff == 0.0}
            agree &= diff == 0.0
        rec = record(
            BENCH,
            spec,
            impl,
            times,
            mean_ms=round(statistics.mean(times), 4),
            ids_per_s=round(ids / (statistics.median(times) * 1e-3)),
            collision_free_rate=round(free, 4),
            policy=policy,
            eviction_interval=interval,
            universe=universe_factor * spec.E,
            drift=drift,
            **extra,
        )
        records.append(rec)
        print(json.dumps(rec), flush=True)
    base = next((r for r in records if r["impl"] == "modulo"), None)
    for r in list(records):
        if base is None or r["impl"] == "modulo":
            continue
        line = {
            "bench": BENCH,
            "impl": r["impl"],
            **spec.as_dict(),
            "ratio_over_modulo": round(r["median_ms"] / base["median_ms"], 3),
            "ratio_meaning": "median_ms / modulo median_ms; > 1 means slower than modulo hashing",
            "collision_free_rate": r["collision_free_rate"],
            "modulo_collision_free_rate": base["collision_free_rate"],
        }
        records.append(line)
        print(json.dumps(line), flush=True)
    if not agree:
        records.append({"bench": BENCH, "error": "MC output != lookup of the remapped rows"})
    return records


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spec_args(p)
    add_timing_args(p)
    p.add_argument("--impl", default=",".join(IMPLS), help=f"comma-separated, from {IMPLS}")
    p.add_argument("--policy", choices=sorted(POLICIES), default="lru")
    p.add_argument("--interval", type=int, default=5, help="eviction interval (calls)")
    p.add_argument("--universe-factor", type=int, default=4, help="raw id universe / E")
    p.add_argument("--drift", type=int, help="universe ranks the window slides per batch")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ok = True
    for spec in specs_from_args(args):
        records = run(
            dataclasses.replace(spec, weighted=False),  # MC features carry no weights here
            args.impl.split(","),
            reps=args.reps,
            warmup=args.warmup,
            seed=args.seed,
            policy=args.policy,
            interval=args.interval,
            universe_factor=args.universe_factor,
            drift=args.drift,
        )
        ok &= not any("error" in r for r in records)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
