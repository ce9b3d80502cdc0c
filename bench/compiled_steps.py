"""Are two checkouts' sharded train steps the same program? A refactor's A/B without timing.

Timing a refactor on a shared 2-core machine cannot resolve a few percent; the
compiled program can: if a commit's optimized HLO equals another's, the step runs
the same kernels, collectives and copies. ``--dump DIR`` writes, from the checkout
it runs in, the optimized HLO of the sharded train step for every sharding type of
``bench/sharded.py`` (pooled EBC, 8 fake CPU devices, ``E=20000``) and for the
sequence test's three plans (``tests/distributed/test_sharded_ec.py``: 1-D with
overflow rounds, 2-D sized from statistics, 2-D with overflow). Source locations
(file names, lines, stack frames, ``metadata``) are removed: they name the
checkout. ``--compare A B`` prints one JSON line per program: its lines in each
and how many differ.

    cd <base checkout> && python <this checkout>/bench/compiled_steps.py --dump /tmp/a
    python bench/compiled_steps.py --dump /tmp/b
    python bench/compiled_steps.py --compare /tmp/a /tmp/b
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys

EBC_SPEC = {"T": 8, "E": 20000, "D": 64, "B": 512, "L": 10}
EC_CASES = (("1d", 1), ("2d", None), ("2d", 1))


def program_text(hlo: str) -> list[str]:
    """The compiled module without its source locations (they name the checkout)."""
    lines = hlo.splitlines()
    if any(line.startswith("StackFrames") for line in lines):  # debug tables first
        i = next(k for k, line in enumerate(lines) if line.startswith("StackFrames"))
        j = next(k for k in range(i, len(lines)) if lines[k].startswith(("%", "ENTRY", "fused")))
        lines = lines[:1] + lines[j:]
    out = []
    for line in lines:
        line = re.sub(r",? ?metadata=\{[^}]*\}", "", line)
        out.append(re.sub(r",? ?stack_frame_id=\d+", "", line))
    return out


def dump(out: pathlib.Path, only: set[str] | None = None) -> None:
    """This checkout's programs (``only``: those names, e.g. ``ebc_row_wise``, ``ec_2d_1``)."""
    root = pathlib.Path.cwd()
    for p in (root, root / "bench", root / "tests", root / "tests" / "distributed"):
        sys.path.insert(0, str(p))
    import numpy as np
    import sharded as bench_sharded
    import test_sharded_ec as ec_cases
    from flax import nnx

    from jaxrec import distributed as d
    from jaxrec import train

    names = [f"ebc_{k}" for k in bench_sharded.TYPES] + [f"ec_{c}_{n}" for c, n in EC_CASES]
    only = set(names) if only is None else only
    if only - set(names):
        raise SystemExit(f"--only: unknown {sorted(only - set(names))}; choose from {names}")
    out.mkdir(parents=True, exist_ok=True)
    spec = bench_sharded.LookupSpec(**EBC_SPEC)
    for kind in bench_sharded.TYPES:
        if f"ebc_{kind}" not in only:
            continue
        gens, hosts = bench_sharded.generators(kind, spec.T)
        mesh = bench_sharded.mesh_for(hosts)
        model = bench_sharded.Model(bench_sharded.build_jaxrec(spec, seed=0))
        world = bench_sharded.WORLD
        plan = d.construct_module_sharding_plan(
            model.ebc, gens, world_size=world, local_size=world // hosts
        )
        model = bench_sharded.shard(model, d.ShardingPlan({"ebc": plan}), mesh, spec)
        batch = d.shard_batch(bench_sharded.local_batches(spec, 0), mesh)
        opt = bench_sharded.optimizer()
        graphdef, state = train.init_train_state(model, opt)
        step = train.make_train_step(graphdef, opt, bench_sharded.loss_fn)
        text = step.lower(state, batch).compile().as_text()
        (out / f"ebc_{kind}.hlo").write_text("\n".join(program_text(text)))
        print(f"ebc {kind}", flush=True)
    local = ec_cases.batches(np.random.default_rng(5))[0]
    for case, capacity in EC_CASES:
        if f"ec_{case}_{capacity}" not in only:
            continue
        gens, make_mesh, hosts = ec_cases.PLANS[case]
        mesh = make_mesh()
        opt = ec_cases._optimizer()
        model = ec_cases.SeqModel(rngs=nnx.Rngs(1))
        plan = d.construct_module_sharding_plan(model.ec, gens, world_size=8, local_size=8 // hosts)
        model = d.DistributedModelParallel(
            model, d.ShardingPlan({"ec": plan}), mesh, capacity=capacity
        )
        graphdef, state = train.init_train_state(model, opt)
        step = train.make_train_step(graphdef, opt, ec_cases.loss_fn)
        text = step.lower(state, d.shard_batch(local, mesh)).compile().as_text()
        (out / f"ec_{case}_{capacity}.hlo").write_text("\n".join(program_text(text)))
        print(f"ec {case} capacity={capacity}", flush=True)


def compare(a: pathlib.Path, b: pathlib.Path) -> int:
    names = sorted({p.name for p in a.glob("*.hlo")} | {p.name for p in b.glob("*.hlo")})
    same = True
    for name in names:
        if not (a / name).exists() or not (b / name).exists():
            print(json.dumps({"program": name, "missing_in": str(a if (b / name).exists() else b)}))
            same = False
            continue
        x, y = (program_text((d / name).read_text()) for d in (a, b))
        differ = sum(u != v for u, v in zip(x, y, strict=False)) + abs(len(x) - len(y))
        same = same and differ == 0
        print(json.dumps({"program": name, "lines": [len(x), len(y)], "lines_differ": differ}))
    return 0 if same else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--dump", type=pathlib.Path, help="write this checkout's programs here")
    g.add_argument("--compare", type=pathlib.Path, nargs=2, metavar=("A", "B"))
    p.add_argument("--only", help="--dump only these programs (comma list; default: all)")
    a = p.parse_args(argv)
    if a.dump:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        dump(a.dump, set(a.only.split(",")) if a.only else None)
        return 0
    return compare(*a.compare)


if __name__ == "__main__":
    raise SystemExit(main())
