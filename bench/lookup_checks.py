"""Which results ``bench/gpu_lookup.py`` compares with float64, and the comparisons.

A workload's forward is checked on up to ``n`` bags at random; its backward on
up to ``n`` unique rows: the ``n // 2`` most repeated (where the order of
summation matters most, and where a load-balanced schedule splits runs; fewer
if their ids exceed ``HOT_IDS``, the float64 sums' cost) and a random sample of
the rest. Each implementation's values there are compared
with ``bench/exact.py``'s float64 results and bounds, one ``Check`` per
implementation and quantity (the forward's output; the updated table and each
optimizer state field), chunk by chunk so that the host's temporaries stay
small whatever the batch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import exact
import numpy as np

CHUNK = 2048  # rows or bags of the float64 reference at a time (in cache, in parallel)
HOT_IDS = 1 << 20  # ids of the most repeated rows checked, at most (and the hottest row)
WORKERS = min(8, len(os.sched_getaffinity(0)))  # numpy releases the GIL on large arrays


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + CHUNK, n)) for lo in range(0, n, CHUNK)]


def _merged(fn, chunks) -> dict[tuple, exact.Check]:
    """``fn(lo, hi)`` (a dict of ``Check`` s) over chunks in threads, merged."""
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        parts = list(pool.map(lambda c: fn(*c), chunks))
    out = {}
    for part in parts:
        for key, c in part.items():
            out[key] = out[key].merge(c) if key in out else c
    return out


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """One workload on the host, in the kernels' layout (ids offset into the stacked
    table, key-major bags), with its rows grouped: ``order`` sorts the ids by row,
    ``unique[u]`` is the row of the ids ``order[ptr[u]:ptr[u + 1]]``."""

    rows: np.ndarray  # [C] int64
    seg: np.ndarray  # [C] int32 bag of each id
    starts: np.ndarray  # [S] int32
    ends: np.ndarray  # [S] int32
    scale: np.ndarray  # [C] float32 per-sample weights or ones (forward)
    bwd_scale: np.ndarray  # [C] float32 the backward's multiplier (/ length for MEAN)
    order: np.ndarray  # [C] int64
    unique: np.ndarray  # [U] int64 sorted
    ptr: np.ndarray  # [U + 1] int64

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.ptr)

    def stats(self) -> dict:
        counts = self.counts
        return {
            "ids": len(self.rows),
            "unique_rows": len(self.unique),
            "bags": len(self.starts),
            "max_dups": int(counts.max()) if counts.size else 0,
        }


def host_batch(rows, seg, lengths, scale, mean: bool) -> HostBatch:
    """``HostBatch`` of ids ``rows [C]`` in bags ``seg [C]`` (``lengths [S]``, key-major)."""
    lengths = np.asarray(lengths, np.int64)
    ends = np.cumsum(lengths)
    bwd_scale = scale
    if mean:  # computed here, once: the device and float64 see the same values
        bwd_scale = scale / np.maximum(lengths[seg], 1).astype(np.float32)
    order = np.argsort(rows, kind="stable")
    sorted_rows = rows[order]
    first = np.flatnonzero(np.r_[True, sorted_rows[1:] != sorted_rows[:-1]][: rows.size])
    return HostBatch(
        rows=rows,
        seg=np.asarray(seg, np.int32),
        starts=(ends - lengths).astype(np.int32),
        ends=ends.astype(np.int32),
        scale=scale,
        bwd_scale=np.asarray(bwd_scale, np.float32),
        order=order,
        unique=sorted_rows[first],
        ptr=np.r_[first, rows.size].astype(np.int64),
    )


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + n)`` for each ``(s, n)``."""
    shift = np.repeat(starts - np.r_[0, np.cumsum(lengths)[:-1]], lengths)
    return (np.arange(int(lengths.sum())) + shift).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Checked:
    """What is compared: ``bags`` (their ids at ``positions``, ``bag_ptr`` per bag;
    ``fwd_rows`` the unique rows they read, ``fwd_index`` each position's among
    them), and unique ``rows`` (``HostBatch.unique[sel]``; their ids ``occ``
    grouped by row, ``occ_ptr`` per row)."""

    bags: np.ndarray
    positions: np.ndarray
    bag_ptr: np.ndarray
    fwd_rows: np.ndarray
    fwd_index: np.ndarray
    sel: np.ndarray
    rows: np.ndarray
    occ: np.ndarray
    occ_ptr: np.ndarray


def choose(h: HostBatch, n: int, seed: int) -> Checked:
    """Up to ``n`` bags at random and up to ``n`` unique rows (module docstring): the
    ``n // 2`` most repeated while their ids number at most ``HOT_IDS`` (always the
    hottest), and a random sample of the rest."""
    rng = np.random.default_rng(seed + 2)
    s, u = len(h.starts), len(h.unique)
    bags = np.arange(s) if s <= n else np.sort(rng.choice(s, n, replace=False))
    lens = (h.ends[bags] - h.starts[bags]).astype(np.int64)
    positions = _ranges(h.starts[bags].astype(np.int64), lens)
    fwd_rows, fwd_index = np.unique(h.rows[positions], return_inverse=True)
    if u <= n:
        sel = np.arange(u)
    else:
        hot = np.argpartition(-h.counts, n // 2)[: n // 2]
        hot = hot[np.argsort(-h.counts[hot], kind="stable")]
        hot = hot[: max(1, np.searchsorted(np.cumsum(h.counts[hot]), HOT_IDS, side="right"))]
        rest = np.ones(u, bool)
        rest[hot] = False
        sel = np.sort(np.r_[hot, rng.choice(np.flatnonzero(rest), n - len(hot), replace=False)])
    counts = h.counts[sel]
    return Checked(
        bags=bags,
        positions=positions,
        bag_ptr=np.r_[0, np.cumsum(lens)],
        fwd_rows=fwd_rows,
        fwd_index=fwd_index.reshape(-1),
        sel=sel,
        rows=h.unique[sel],
        occ=h.order[_ranges(h.ptr[sel], counts)],
        occ_ptr=np.r_[0, np.cumsum(counts)],
    )


def gradient_sums(h: HostBatch, chk: Checked, out_grad: np.ndarray) -> list[exact.Bounded]:
    """The checked rows' summed gradients in float64, bounded, in chunks of ``CHUNK`` rows."""

    def one(lo, hi):
        a, z = chk.occ_ptr[lo], chk.occ_ptr[hi]
        occ = chk.occ[a:z]
        indptr = chk.occ_ptr[lo : hi + 1] - a
        return exact.bounded_sums(out_grad, h.seg[occ], h.bwd_scale[occ], indptr)

    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(lambda c: one(*c), _chunks(len(chk.rows))))


def state_fields(state) -> tuple[str, ...]:
    """A ``jaxrec.optim`` state's per-row fields (all but ``count``)."""
    return tuple(f for f in state._fields if f != "count")


def check_update(opt, state0, dtype: str, w0, sums, got: dict) -> dict[tuple, exact.Check]:
    """One optimizer step from rows ``w0`` (state ``state0``'s zeros, count 1) against
    ``got[impl] = (table rows, {field: state rows})``; ``Check`` per (impl, quantity).
    ``sums``: :func:`gradient_sums`' chunks."""
    fields = state_fields(state0)

    def one(lo, hi):
        zeros = {f: np.zeros((hi - lo, *getattr(state0, f).shape[1:])) for f in fields}
        g = sums[lo // CHUNK]
        w, new = exact.optimizer_step(opt, exact.exact(w0[lo:hi]), g, zeros, count=1)
        refs = {"table": exact.store(w, dtype), **new}
        checks = {}
        for impl, (table_rows, state_rows) in got.items():
            for q, ref in refs.items():
                checks[impl, q] = exact.Check()
                checks[impl, q].add((table_rows if q == "table" else state_rows[q])[lo:hi], ref)
        return checks

    return _merged(one, _chunks(len(w0)))


def check_forward(
    h: HostBatch,
    chk: Checked,
    values: np.ndarray,
    mean: bool,
    dtype: str,
    got: dict,
    torch_out=None,
) -> dict[tuple, exact.Check]:
    """Pooled outputs at the checked bags (``got[impl]``; ``torch_out`` rounded to the
    table's ``dtype``, as torch returns it) against float64 sums of the table rows
    ``values`` (``[len(chk.fwd_rows), D]``); ``Check`` per (impl, "out")."""
    outs = dict(got) | ({} if torch_out is None else {"torch": torch_out})

    def one(lo, hi):
        a, z = chk.bag_ptr[lo], chk.bag_ptr[hi]
        scale = h.scale[chk.positions[a:z]]
        ref = exact.bounded_sums(values, chk.fwd_index[a:z], scale, chk.bag_ptr[lo : hi + 1] - a)
        if mean:
            lengths = (h.ends - h.starts)[chk.bags[lo:hi]].astype(np.float64)
            ref = exact.div(ref, exact.exact(np.maximum(lengths, 1)[:, None]))
        checks = {(impl, "out"): exact.Check() for impl in outs}
        for impl, out in outs.items():
            checks[impl, "out"].add(out[lo:hi], exact.store(ref, dtype) if impl == "torch" else ref)
        return checks

    return _merged(one, _chunks(len(chk.bags)))


def check_sequence(chk: Checked, values: np.ndarray, got: dict) -> dict[tuple, exact.Check]:
    """Sequence outputs at the checked bags' positions: the table rows exactly."""

    def one(lo, hi):
        ref = exact.exact(values[chk.fwd_index[lo:hi]])
        checks = {(impl, "out"): exact.Check() for impl in got}
        for impl, out in got.items():
            checks[impl, "out"].add(out[lo:hi], ref)
        return checks

    return _merged(one, _chunks(len(chk.positions)))


def summary(checks: dict[tuple, exact.Check], jax_impls) -> dict:
    """The ``agree`` line's fields: each implementation within its bounds (all its
    quantities), ``agree`` for Pallas's default schedule, ``ok`` for every JAX one."""
    impls = sorted({i for i, _ in checks})
    within = {i: all(c.within_bound for (j, _), c in checks.items() if j == i) for i in impls}
    prob = {
        i: all(c.within_probabilistic_bound for (j, _), c in checks.items() if j == i)
        for i in impls
    }
    return {
        "compare": "float64",
        "within_bound": within,
        "within_prob_bound": prob,
        "agree": within.get("pallas"),
        "ok": all(v for i, v in within.items() if i in jax_impls),
    }
