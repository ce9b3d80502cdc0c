"""Enumerator: the candidate shardings of each table (TorchRec's ``EmbeddingEnumerator``).

Per table and allowed sharding type:

- data_parallel, table_wise, row_wise (over every allowed rank): one option;
- column_wise and table_column_wise: ``k`` equal column blocks for each ``k``
  dividing the dimension with blocks of at least ``min_partition`` columns
  (default 32; a table whose constraints allow only column splits gets the
  widest even split if none qualifies), ``k`` up to the devices (or a host's);
- table_row_wise: rows over one host's devices; grid_shard: ``h`` column blocks,
  each split by rows over one host, for each valid ``h``.

Host-based types are enumerated only on multi-host topologies unless a
constraint names them (on one host they equal row-wise / column-wise). Rows
and columns split in ceil-sized blocks, as the plan builders do.

Every sharded option whose table allows ``fused_uvm_caching`` also comes
cached (the same shards, the table's ``cache_params``) when ``caching`` is
asked for (the planner asks only when nothing fits in device memory), and
only cached for a table whose constraints exclude ``fused``. Data-parallel
tables are never cached, and the planner does not choose to cache a shard whose
cache would not hold the distinct rows of one step (uniform ids assumed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..types import CacheParams, EmbeddingComputeKernel, ShardingType, cache_slots
from .cost_model import CostModel
from .options import ShardingOption, ShardSpec, TableInfo

MIN_PARTITION = 32
ST = ShardingType
HOST_TYPES = (ST.TABLE_ROW_WISE, ST.TABLE_COLUMN_WISE, ST.GRID_SHARD)


def _blocks(n: int, k: int) -> list[tuple[int, int]]:
    size = -(-n // k)
    return [(min(i * size, n), max(0, min(size, n - i * size))) for i in range(k)]


def _column_splits(dim: int, most: int, min_partition: int | None, only: bool) -> list[int]:
    ks = [k for k in range(2, most + 1) if dim % k == 0]
    good = [k for k in ks if dim // k >= (min_partition or MIN_PARTITION)]
    if not good and only and ks:
        good = [ks[0]]
    return good


def enumerate_options(
    table: TableInfo, cost: CostModel, caching: bool = False
) -> list[ShardingOption]:
    """Every allowed option of ``table``, with standalone estimates, in a fixed order
    (``fused`` ones first; cached ones too with ``caching`` or when only they are
    allowed)."""
    topo = cost.topology
    c = table.constraints
    n, lo, hosts = topo.world_size, topo.ranks_per_host, topo.num_hosts
    allowed_ranks = tuple(range(n)) if c.ranks is None else tuple(sorted(set(c.ranks)))
    bad = [r for r in allowed_ranks if not 0 <= r < n]
    if bad:
        raise ValueError(f"table {table.key!r}: constraint ranks {bad} outside {n} devices")
    full = len(allowed_ranks) == n
    ok_hosts = [h for h in range(hosts) if set(topo.host_ranks(h)) <= set(allowed_ranks)]
    explicit = c.sharding_types or ()
    only_cols = bool(explicit) and all(
        t in (ST.COLUMN_WISE, ST.TABLE_COLUMN_WISE, ST.GRID_SHARD) for t in explicit
    )
    rows, dim = table.rows, table.dim
    whole = ShardSpec(0, rows, 0, dim)
    out: list[tuple[ShardingType, tuple[ShardSpec, ...], str, tuple[int, ...], int]] = []
    for st in ST:
        if not c.allows(st):
            continue
        if st in HOST_TYPES and hosts == 1 and st not in explicit:
            continue
        if st is ST.DATA_PARALLEL and full:
            out.append((st, (whole,), "replicated", (), 0))
        elif st is ST.TABLE_WISE:
            out.append((st, (whole,), "free", allowed_ranks, 0))
        elif st is ST.ROW_WISE and len(allowed_ranks) > 1:
            shards = tuple(
                ShardSpec(r0, nr, 0, dim) for r0, nr in _blocks(rows, len(allowed_ranks))
            )
            out.append((st, shards, "fixed", allowed_ranks, 0))
        elif st is ST.COLUMN_WISE:
            for k in _column_splits(dim, len(allowed_ranks), c.min_partition, only_cols):
                shards = tuple(ShardSpec(0, rows, c0, nc) for c0, nc in _blocks(dim, k))
                out.append((st, shards, "free", allowed_ranks, 0))
        elif st is ST.TABLE_ROW_WISE and ok_hosts and lo > 1:
            shards = tuple(ShardSpec(r0, nr, 0, dim) for r0, nr in _blocks(rows, lo))
            out.append((st, shards, "host", tuple(ok_hosts), 1))
        elif st is ST.TABLE_COLUMN_WISE and ok_hosts:
            for k in _column_splits(dim, lo, c.min_partition, only_cols):
                shards = tuple(ShardSpec(0, rows, c0, nc) for c0, nc in _blocks(dim, k))
                out.append((st, shards, "host", tuple(ok_hosts), 1))
        elif st is ST.GRID_SHARD and len(ok_hosts) > 1:
            for h in _column_splits(dim, len(ok_hosts), c.min_partition, only_cols):
                shards = tuple(
                    ShardSpec(r0, nr, c0, nc)
                    for c0, nc in _blocks(dim, h)
                    for r0, nr in _blocks(rows, lo)
                )
                out.append((st, shards, "host", tuple(ok_hosts), h))
    fused = [estimate_option(table, cost, *o) for o in out]
    cache = table.constraints.cache_params or CacheParams()
    cached = [
        estimate_option(table, cost, *o, cache=cache)
        for o in out
        if EmbeddingComputeKernel.FUSED_UVM_CACHING in table.constraints.kernels(o[0])
    ]
    if table.constraints.cache_only:  # asked for: a too-small cache fails at its first batch
        return [o for o in fused if o.placement == "replicated"] + cached
    cached = [o for o in cached if _cache_holds_a_step(table, o.shards, cache, n)]
    return fused + cached if caching else fused


def _cache_holds_a_step(table: TableInfo, shards, cache: CacheParams, world: int) -> bool:
    """Whether each shard's cache holds the distinct rows one step is expected to look up
    on it (ids spread uniformly: ``rows * (1 - exp(-ids / rows))``). jaxrec's cache
    needs every row of a batch in a slot; a table looked up more densely than that
    (a small table at a small load factor) is no candidate for caching."""
    for sh in shards:
        if sh.nrows and sh.ncols:
            ids = world * table.expected_ids * sh.nrows / table.rows  # every device's
            distinct = sh.nrows * -math.expm1(-ids / sh.nrows)
            if cache_slots(sh.nrows, cache.load_factor) < distinct:
                return False
    return True


def estimate_option(
    table: TableInfo,
    cost: CostModel,
    st,
    shards,
    placement,
    ranks,
    blocks=0,
    cache: CacheParams | None = None,
) -> ShardingOption:
    """A ``ShardingOption`` with its standalone storage and perf estimates."""
    host = total_host = 0.0
    if placement == "replicated":
        (w, s, io), perf = cost.replicated(table)
        per_device, total, seconds = w + s + io, (w + s + io) * cost.topology.world_size, perf.total
        seconds *= cost.topology.world_size  # every device does it
    else:
        per_device = total = seconds = 0.0
        for ncols in sorted({sh.ncols for sh in shards if sh.nrows and sh.ncols}):
            nrows = [sh.nrows for sh in shards if sh.nrows and sh.ncols == ncols]
            mem, sec, hb = cost.standalone(table, nrows, ncols, cache)
            per_device = max(per_device, float(mem.max()))
            total += float(mem.sum())
            seconds += float(sec.sum())
            host = max(host, float(hb.max()))
            total_host += float(hb.sum())
    return ShardingOption(
        table=table,
        sharding_type=st,
        shards=shards,
        placement=placement,
        ranks=ranks,
        blocks=blocks,
        per_device_bytes=per_device,
        total_bytes=total,
        perf=seconds,
        cache=cache,
        host_bytes=host,
        total_host_bytes=total_host,
    )


def enumerate_all(
    tables: Sequence[TableInfo], cost: CostModel, caching: bool = False
) -> list[list[ShardingOption]]:
    return [enumerate_options(t, cost, caching) for t in tables]
