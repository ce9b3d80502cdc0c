"""Dynamic-table benchmark: a HashZch-indexed table against a plain table of the same capacity.

For a ``LookupSpec`` (``T`` tables of ``E`` slots, dim ``D``, batch ``B``,
``L`` ids a bag, Zipf ``alpha``), every step draws fresh 64-bit raw ids (high
words set, passed as ``uint32[N, 2]`` id words) from a universe
``--universe-factor`` times larger than a table whose Zipf window slides by
``--drift`` ranks a step, so every step brings new ids. Implementations, each
jitted and timed on the same batches (one new batch per call):

* ``plain`` (the reference): an ``EmbeddingBagCollection`` of ``E`` rows looked
  up with ``raw_id % E`` rows computed on the host (no index, collisions);
* ``dynamic_eval``: ``ManagedCollisionEmbeddingBagCollection`` of
  ``HashZchManagedCollisionModule`` s in eval mode (hash, ``W``-way probe,
  lookup; no state change);
* ``dynamic_train_forward``: its training forward (probe, admission,
  eviction, reset of the evicted rows, lookup), state donated.

Both collections run with ``BoundsCheckMode.IGNORE`` (a dynamic table needs
it: rejected ids read zeros), so the lookups do the same work. The dynamic
tables are first trained with ``--fill-steps`` forward calls (until 95% full
or that many calls), so timed calls evict as in a long run. Then:

* ``train_step`` lines: ``jaxrec.train.make_train_step`` (row-wise Adagrad,
  ``loss = sum(pooled * R)``) on the dynamic collection and on the plain one;
* ``breakdown`` lines (``--breakdown``): the index's parts alone on one
  table's ids (hash, eval probe, training index program, and that program as XLA), to
  say where the dynamic table's time goes;
* a ``memory`` line: bytes of a module's state arrays per slot against
  ``INDEX_BYTES_PER_SLOT`` (+ ``SKETCH_BYTES_PER_SLOT``), and as a share of an
  fp32 row;
* ``occupancy`` lines, one per policy (LRU, LFU, SINGLE_TTL, LRU with
  ``FrequencyAdmission(threshold=2)``): one table of ``--occ-slots`` slots
  trained ``--occ-steps`` calls on the drifting stream (``B * L`` ids a
  call): occupancy, admitted / evicted / rejected per call, and the hit rate
  (ids found in a slot on arrival) and served rate (ids with a slot after the
  call), summarised and as a series every ``--occ-every`` calls.

Every timed line has ``ids_per_s``; ``ratio`` lines give median time over
``plain``'s (> 1: slower than the plain table). The run exits 1 when the eval
output differs from the plain lookup of the rows the index returns.

Run from the repository root (``PYTHONPATH=.`` or jaxrec installed)::

    python bench/dynamic_table.py --preset tiny
    python bench/dynamic_table.py --preset default --breakdown --out results.jsonl
    python bench/dynamic_table.py --preset large --reps 5 --no-train-step --occ-steps 0
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import emit, machine, record, time_ms
from flax import nnx
from specs import LookupSpec

from jaxrec import (
    BoundsCheckMode,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    optim,
)
from jaxrec.embedding import CombinedOptimizer
from jaxrec.modules import (
    FrequencyAdmission,
    HashZchEvictionConfig,
    HashZchEvictionPolicyName,
    HashZchManagedCollisionModule,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
)
from jaxrec.modules import zch_index as zi
from jaxrec.sparse.ids64 import to_id_words
from jaxrec.train import init_train_state, make_train_step

BENCH = "dynamic_table"
IMPLS = ("plain", "dynamic_eval", "dynamic_train_forward")
P = HashZchEvictionPolicyName
PRESETS: dict[str, LookupSpec] = {
    "tiny": LookupSpec(T=2, E=1024, D=16, B=32, L=4, alpha=1.1),
    "default": LookupSpec(T=4, E=1_000_000, D=64, B=2048, L=10, alpha=1.1),
    "large": LookupSpec(T=1, E=10_000_000, D=64, B=2048, L=10, alpha=1.1),
}
# Occupancy study: name -> (eviction config, admission).
POLICIES = {
    "lru": (HashZchEvictionConfig(policy=P.LRU_EVICTION), None),
    "lfu": (HashZchEvictionConfig(policy=P.LFU_EVICTION), None),
    "single_ttl": (HashZchEvictionConfig(policy=P.SINGLE_TTL_EVICTION, single_ttl=10), None),
    "lru_freq2": (HashZchEvictionConfig(policy=P.LRU_EVICTION), FrequencyAdmission(threshold=2)),
}
HIT_MEANING = "share of a call's ids found in a slot on arrival (eval remap before the call)"
SERVED_MEANING = "share of a call's ids with a slot after the training call (hits + admitted)"
HIGH = np.uint64(0x9E37_79B9_7F4A_7C15)  # odd: index -> 64-bit id is a bijection


# ----- the id stream -----
def zipf_ranks(rng: np.random.Generator, n: int, alpha: float, size: int) -> np.ndarray:
    """``size`` 0-based ranks in ``[0, n)``, ``P(k) ~ (k + 1)**-alpha`` (inverse CDF, not scattered:
    rank ``k`` is the same id's popularity from step to step, unlike ``specs.zipf_ids``)."""
    u = rng.random(size)
    if abs(alpha - 1.0) < 1e-9:
        x = np.exp(u * np.log(n + 1.0))
    else:
        a = 1.0 - alpha
        x = (1.0 + u * ((n + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.minimum(x.astype(np.int64) - 1, n - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stream:
    """Zipf ranks over a window of ``factor * slots`` ids that slides ``drift`` ids a step.

    Step ``i`` draws rank ``k`` as id number ``k + i * drift``: an id enters at the
    cold end of the window, warms up as the window slides past it, and leaves
    after the head; ``drift`` new ids enter every step.
    """

    slots: int
    alpha: float
    factor: int
    drift: int
    seed: int

    def raw(self, step: int, tables: int, n: int) -> np.ndarray:
        """``uint64[tables * n]`` raw ids of step ``step``, key-major (table ``t``'s ids differ)."""
        rng = np.random.default_rng((self.seed, step))
        universe = self.factor * self.slots
        rank = zipf_ranks(rng, universe, self.alpha, tables * n).astype(np.uint64)
        index = rank + np.uint64(step * self.drift)  # an id's rank falls by `drift` a step
        table = np.repeat(np.arange(tables, dtype=np.uint64), n)
        with np.errstate(over="ignore"):  # wraps mod 2**64 by design
            raw = (index + (table << np.uint64(48))) * HIGH
        return raw | np.uint64(1 << 40)  # high word never 0


def kjt_of(spec: LookupSpec, values) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_parts(
        [f"f{t}" for t in range(spec.T)],
        jnp.asarray(values),
        jnp.full((spec.T * spec.B,), spec.L, jnp.int32),
        capacities=[spec.B * spec.L] * spec.T,
        stride=spec.B,
    )


def batches(spec: LookupSpec, stream: Stream, step: int):
    """``(id-word KJT, plain-row KJT (raw % E))`` of one step."""
    raw = stream.raw(step, spec.T, spec.B * spec.L)
    rows = (raw % np.uint64(spec.E)).astype(np.int32)
    return kjt_of(spec, to_id_words(raw)), kjt_of(spec, rows)


# ----- models -----
def tables(spec: LookupSpec) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{t}", num_embeddings=spec.E, embedding_dim=spec.D, feature_names=[f"f{t}"]
        )
        for t in range(spec.T)
    ]


def build_plain(spec: LookupSpec, seed: int) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables(spec), rngs=nnx.Rngs(seed), bounds_check_mode=BoundsCheckMode.IGNORE
    )


def build_dynamic(
    spec: LookupSpec, seed: int, ways: int, eviction=POLICIES["lru"][0], admission=None
) -> ManagedCollisionEmbeddingBagCollection:
    cfgs = tables(spec)
    mcs = {
        c.name: HashZchManagedCollisionModule(
            spec.E, ways=ways, eviction_config=eviction, admission=admission, input_hash_seed=t
        )
        for t, c in enumerate(cfgs)
    }
    ebc = build_plain(spec, seed)
    return ManagedCollisionEmbeddingBagCollection(
        ebc, ManagedCollisionCollection(mcs, cfgs), rngs=nnx.Rngs(seed)
    )


def counters(mc: ManagedCollisionEmbeddingBagCollection) -> dict[str, int]:
    """Summed over tables: the latest call's counters and the occupancy."""
    mods = mc.managed_collision_collection.managed_collision_modules.values()
    out: dict[str, int] = {}
    for m in mods:
        for k, v in m.counters().items():
            out[k] = out.get(k, 0) + int(v)
    return out


# ----- 1. forward -----
def run_forward(spec, stream, args, out) -> tuple[list[dict], nnx.Module, bool]:
    mc = build_dynamic(spec, args.seed, args.ways)
    step0 = batches(spec, stream, 0)[0]
    mc.ensure_buffers(step0)
    graphdef, state = nnx.split(mc)
    pgraph, pstate = nnx.split(build_plain(spec, args.seed))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_fwd(state, kjt):
        m = nnx.merge(graphdef, state)
        pooled, _ = m(kjt, deterministic=False)
        return nnx.state(m), pooled.values()

    @jax.jit
    def eval_fwd(state, kjt):
        pooled, _ = nnx.merge(graphdef, state)(kjt, deterministic=True)
        return pooled.values()

    @jax.jit
    def plain_fwd(pstate, kjt):
        return nnx.merge(pgraph, pstate)(kjt).values()

    # fill the index (training forward calls) until 95% full or --fill-steps
    step, start = 0, time.perf_counter()
    full = 0.0
    while step < args.fill_steps and full < 0.95:
        state, _ = train_fwd(state, batches(spec, stream, step)[0])
        step += 1
        if step % 10 == 0 or step == args.fill_steps:
            full = counters(nnx.merge(graphdef, state))["occupancy"] / (spec.T * spec.E)
    jax.block_until_ready(state)
    fill = {
        "fill_steps": step,
        "fill_s": round(time.perf_counter() - start, 2),
        "occupancy_at_timing": round(
            counters(nnx.merge(graphdef, state))["occupancy"] / (spec.T * spec.E), 4
        ),
    }

    n = args.warmup + args.reps
    data = [batches(spec, stream, step + i) for i in range(n)]
    box = {"state": state, "i": 0}

    def nxt(j: int):
        box["i"] = (box["i"] + 1) % n
        return data[box["i"]][j]

    def train_call():
        box["state"], y = train_fwd(box["state"], nxt(0))
        y.block_until_ready()

    calls: dict[str, Callable[[], None]] = {
        "plain": lambda: plain_fwd(pstate, nxt(1)).block_until_ready(),
        "dynamic_eval": lambda: eval_fwd(box["state"], nxt(0)).block_until_ready(),
        "dynamic_train_forward": train_call,
    }
    ids = spec.T * spec.B * spec.L
    recs, agree = [], True
    for impl in args.impl.split(","):
        box["i"] = -1  # every implementation sees the same batches in the same order
        times = time_ms(calls[impl], args.reps, args.warmup)
        extra = {}
        if impl == "dynamic_train_forward":
            c = counters(nnx.merge(graphdef, box["state"]))
            extra = {"last_call": c, "occupancy": round(c["occupancy"] / (spec.T * spec.E), 4)}
        if impl == "dynamic_eval":  # eval output == plain lookup of the index's rows
            m = nnx.merge(graphdef, box["state"])
            kjt = data[0][0]
            rows = jax.jit(lambda m, k: m.managed_collision_collection(k, deterministic=True))(
                m, kjt
            )
            want = jax.jit(lambda e, k: e(k).values())(m.embedding_bag_collection, rows)
            diff = float(jnp.max(jnp.abs(eval_fwd(box["state"], kjt) - want)))
            extra = {"max_abs_diff": diff, "outputs_agree": diff == 0.0}
            extra["hit_rate"] = round(float(jnp.mean(rows.values() != zi.FILL)), 4)
            agree &= diff == 0.0
        recs.append(_timed("forward", spec, impl, times, ids, args, stream, **fill, **extra))
        emit(recs[-1], out)
    _ratios(recs, spec, "forward", out)
    return recs, nnx.merge(graphdef, box["state"]), agree


def _timed(kind, spec, impl, times, ids, args, stream, **extra) -> dict:
    return record(
        BENCH,
        spec,
        impl,
        times,
        kind=kind,
        preset=args.preset,
        mean_ms=round(statistics.mean(times), 4),
        ids_per_s=round(ids / (statistics.median(times) * 1e-3)),
        ways=args.ways,
        universe=stream.factor * stream.slots,
        drift=stream.drift,
        machine=machine(),
        **extra,
    )


def _ratios(recs: list[dict], spec: LookupSpec, kind: str, out) -> None:
    base = next((r for r in recs if r["impl"] == "plain"), None)
    for r in recs:
        if base is None or r["impl"] == "plain":
            continue
        emit(
            {
                "bench": BENCH,
                "kind": kind + "_ratio",
                "impl": r["impl"],
                **spec.as_dict(),
                "ratio_over_plain": round(r["median_ms"] / base["median_ms"], 3),
                "ratio_meaning": "median_ms / plain median_ms (same run); > 1: slower than plain",
                "goal": "forward within 1.5x of a plain table (issue 49)"
                if kind == "forward"
                else None,
            },
            out,
        )


# ----- 2. train step -----
def run_train_step(spec, stream, args, mc, out) -> list[dict]:
    opt = CombinedOptimizer(optax.sgd(0.0), optim.rowwise_adagrad(0.05))
    proj = jnp.asarray(
        np.random.default_rng(args.seed).standard_normal((spec.B, spec.T * spec.D)), jnp.float32
    )

    def dyn_loss(model, kjt):
        return jnp.sum(model(kjt)[0].values() * proj)

    def plain_loss(model, kjt):
        return jnp.sum(model(kjt).values() * proj)

    n = args.warmup + args.reps
    base = 10_000  # steps past the forward run's
    data = [batches(spec, stream, base + i) for i in range(n)]
    recs = []
    for impl, model, loss, j in (
        ("plain", build_plain(spec, args.seed), plain_loss, 1),
        ("dynamic", mc, dyn_loss, 0),
    ):
        graphdef, state = init_train_state(model, opt)
        step = make_train_step(graphdef, opt, loss)
        box = {"state": state, "i": -1}
        del model

        def one(box=box, step=step, j=j):
            box["i"] = (box["i"] + 1) % n
            box["state"], loss_value, _ = step(box["state"], data[box["i"]][j])
            jax.block_until_ready(loss_value)

        times = time_ms(one, args.reps, args.warmup)
        recs.append(
            _timed(
                "train_step",
                spec,
                impl,
                times,
                spec.T * spec.B * spec.L,
                args,
                stream,
                optimizer="EXACT_ROWWISE_ADAGRAD",
                learning_rate=0.05,
            )
        )
        emit(recs[-1], out)
        box.clear()
    _ratios(recs, spec, "train_step", out)
    return recs


# ----- breakdown: the index's parts on one table's ids -----
def run_breakdown(spec, stream, args, mc, out) -> None:
    mod = mc.managed_collision_collection.managed_collision_modules["t0"]
    lay, st = mod.layout, jax.tree.map(jnp.copy, mod.state())
    c = spec.B * spec.L
    n = args.warmup + args.reps
    words = [jnp.asarray(to_id_words(stream.raw(20_000 + i, 1, c))) for i in range(n)]
    ok = jnp.ones((c,), bool)

    xla = dataclasses.replace(lay, implementation="xla")
    parts = {
        "hash": jax.jit(lambda s, lo, hi: zi.buckets_of(lay, lo, hi)[0]),
        "hash_and_probe (eval remap)": jax.jit(lambda s, lo, hi: zi.remap(lay, s, lo, hi, ok)),
        "train_index (full index program)": jax.jit(
            lambda s, lo, hi: (
                zi.train_step(lay, s, lo, hi, ok, max_evictions=mod.max_evictions).rows
            )
        ),
        "train_index_xla (the XLA program on CPU)": jax.jit(
            lambda s, lo, hi: (
                zi.train_step(xla, s, lo, hi, ok, max_evictions=mod.max_evictions).rows
            )
        ),
    }
    for name, fn in parts.items():
        box = {"i": -1}

        def call(fn=fn, box=box):
            box["i"] = (box["i"] + 1) % n
            w = words[box["i"]]
            fn(st, w[:, 0], w[:, 1]).block_until_ready()

        times = time_ms(call, args.reps, args.warmup)
        note = "one table's ids; the index's state is not updated between calls"
        emit(
            _timed("breakdown", spec, name, times, c, args, stream, ids_per_call=c, note=note), out
        )


# ----- 3. memory -----
def memory_line(spec: LookupSpec, args, out) -> dict:
    rows = {}
    for name, (ev, adm) in (
        ("no_admission", POLICIES["lru"]),
        ("frequency_admission", POLICIES["lru_freq2"]),
    ):
        m = HashZchManagedCollisionModule(spec.E, ways=args.ways, eviction_config=ev, admission=adm)
        m.ensure_buffers(spec.B * spec.L)
        st = m.state()
        per_slot = sum(int(a.nbytes) for a in st if a.ndim == 1 and a.shape[0] == spec.E)
        total = sum(int(a.nbytes) for a in jax.tree.leaves(nnx.state(m)))
        model = zi.INDEX_BYTES_PER_SLOT + (zi.SKETCH_BYTES_PER_SLOT if adm else 0)
        rows[name] = {
            "slot_array_bytes_per_slot": per_slot / spec.E,
            "all_state_bytes_per_slot": round(total / spec.E, 4),
            "documented_bytes_per_slot": model,
            "matches_documented": per_slot / spec.E == model,
            "share_of_fp32_row": round(per_slot / spec.E / (spec.D * 4), 4),
        }
    rec = {
        "bench": BENCH,
        "kind": "memory",
        "preset": args.preset,
        **spec.as_dict(),
        "slots": spec.E,
        "row_bytes": spec.D * 4,
        **rows,
    }
    emit(rec, out)
    return rec


# ----- 4. occupancy and eviction -----
def run_occupancy(spec, args, out) -> list[dict]:
    slots, c = args.occ_slots or spec.E, spec.B * spec.L
    stream = Stream(
        slots=slots,
        alpha=spec.alpha,
        factor=args.universe_factor,
        drift=args.occ_drift or max(slots // 1000, 1),
        seed=args.seed + 1,
    )
    words = [jnp.asarray(to_id_words(stream.raw(i, 1, c))) for i in range(args.occ_steps)]
    recs = []
    for name, (ev, adm) in POLICIES.items():
        m = HashZchManagedCollisionModule(slots, ways=args.ways, eviction_config=ev, admission=adm)
        m.ensure_buffers(c)
        graphdef, state = nnx.split(m)

        @functools.partial(jax.jit, donate_argnums=0)
        def call(state, w, graphdef=graphdef):
            mod = nnx.merge(graphdef, state)
            hit = mod.forward_flat(w, deterministic=True) != zi.FILL
            served = mod.forward_flat(w, deterministic=False) != zi.FILL
            cnt = mod.counters()
            stats = jnp.stack([jnp.mean(hit), jnp.mean(served)])
            return (
                nnx.state(mod),
                stats,
                jnp.stack([cnt[k] for k in ("admitted", "evicted", "rejected", "occupancy")]),
            )

        series = []
        for w in words:
            state, stats, cnt = call(state, w)
            series.append((*np.asarray(stats).tolist(), *np.asarray(cnt).tolist()))
        s = np.asarray(series)
        half, full = s[len(s) // 2 :], s[:, 5] >= slots
        every = max(args.occ_every, 1)
        rec = {
            "bench": BENCH,
            "kind": "occupancy",
            "preset": args.preset,
            "policy": name,
            "eviction": ev.policy.name,
            "single_ttl": ev.single_ttl,
            "admission": f"FrequencyAdmission(threshold={adm.threshold})" if adm else None,
            "slots": slots,
            "ways": args.ways,
            "ids_per_call": c,
            "calls": len(s),
            "alpha": spec.alpha,
            "universe": stream.factor * slots,
            "drift": stream.drift,
            "final_occupancy": int(s[-1, 5]),
            "final_occupancy_share": round(s[-1, 5] / slots, 4),
            "first_call_full": int(np.argmax(full)) + 1 if full.any() else None,
            "admitted_total": int(s[:, 2].sum()),
            "evicted_total": int(s[:, 3].sum()),
            "rejected_total": int(s[:, 4].sum()),
            "hit_rate_second_half": round(float(half[:, 0].mean()), 4),
            "served_rate_second_half": round(float(half[:, 1].mean()), 4),
            "admitted_per_call_second_half": round(float(half[:, 2].mean()), 1),
            "evicted_per_call_second_half": round(float(half[:, 3].mean()), 1),
            "rejected_per_call_second_half": round(float(half[:, 4].mean()), 1),
            "series_every": every,
            "series": {
                "call": list(range(every, len(s) + 1, every)),
                "occupancy": [int(x) for x in s[every - 1 :: every, 5]],
                "hit_rate": [round(float(x), 4) for x in s[every - 1 :: every, 0]],
                "admitted": [int(x) for x in s[every - 1 :: every, 2]],
                "evicted": [int(x) for x in s[every - 1 :: every, 3]],
                "rejected": [int(x) for x in s[every - 1 :: every, 4]],
            },
            "hit_rate_meaning": HIT_MEANING,
            "served_rate_meaning": SERVED_MEANING,
            "machine": machine(),
        }
        recs.append(rec)
        emit(rec, out)
    return recs


# ----- arguments -----
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    for name in ("T", "E", "D", "B", "L"):
        p.add_argument(f"--{name}", type=int, help="overrides the preset")
    p.add_argument("--alpha", type=float, help="Zipf exponent (overrides the preset)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", default=",".join(IMPLS), help=f"comma-separated, from {IMPLS}")
    p.add_argument("--ways", type=int, default=16)
    p.add_argument("--universe-factor", type=int, default=4, help="raw id universe / slots")
    p.add_argument("--drift", type=int, help="ids the window slides a step; default E // 1000")
    p.add_argument("--fill-steps", type=int, default=150, help="most warm-up training calls")
    p.add_argument("--no-train-step", dest="train_step", action="store_false")
    p.add_argument("--breakdown", action="store_true", help="time the index's parts")
    p.add_argument("--occ-slots", type=int, help="occupancy study's slots; default E")
    p.add_argument("--occ-steps", type=int, default=100, help="occupancy study's calls (0: skip)")
    p.add_argument("--occ-drift", type=int, help="default occ-slots // 1000")
    p.add_argument("--occ-every", type=int, default=10, help="series sampling (calls)")
    p.add_argument("--out", help="also append the JSON lines to this file")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    over = {
        k: getattr(args, k)
        for k in ("T", "E", "D", "B", "L", "alpha")
        if getattr(args, k) is not None
    }
    spec = dataclasses.replace(PRESETS[args.preset], **over)
    bad = sorted(set(args.impl.split(",")) - set(IMPLS))
    if bad:
        raise SystemExit(f"unknown impls {bad}; choose from {IMPLS}")
    stream = Stream(
        slots=spec.E,
        alpha=spec.alpha,
        factor=args.universe_factor,
        drift=args.drift or max(spec.E // 1000, 1),
        seed=args.seed,
    )
    memory_line(spec, args, args.out)
    _, mc, agree = run_forward(spec, stream, args, args.out)
    if args.breakdown:
        run_breakdown(spec, stream, args, mc, args.out)
    if args.train_step:
        run_train_step(spec, stream, args, mc, args.out)
    del mc
    if args.occ_steps:
        run_occupancy(spec, args, args.out)
    if not agree:
        emit(
            {"bench": BENCH, "error": "dynamic eval output != plain lookup of the index's rows"},
            args.out,
        )
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
