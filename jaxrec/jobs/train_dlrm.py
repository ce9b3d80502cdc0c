"""The main job: train DLRM (or DLRM-DCN) on click data, evaluate, checkpoint, resume.

Flags: ``jaxrec-train-dlrm --help`` (``dlrm_flags.py``).

``jaxrec-train-dlrm`` (console script) and ``python examples/train_dlrm.py``
run :func:`jaxrec.jobs.dlrm_cli.main` (flags parsed before JAX loads), then
:func:`run`; :func:`main` parses and runs in one call. By default it trains on
synthetic Criteo-like data with a planted model (about a minute on two CPU
cores); ``--dataset criteo`` reads Criteo TSV or preprocessed npy day files,
``--dataset movielens`` MovieLens (``python -m jaxrec.datasets.movielens
fetch`` gets ml-100k). With ``--devices N > 1`` the embedding tables are
sharded over N devices (the planner's plan, or ``--sharding``); on a CPU host
N fake devices are made.

Tables larger than the devices' memory live in host memory with a device cache
of their rows (TorchRec's ``fused_uvm_caching``, :mod:`jaxrec.cache`): the
planner caches what does not fit (``--hbm-gib`` sets the device memory it plans
for), ``--cache-tables`` caches named tables always; ``--cache-load-factor`` and
``--cache-algorithm`` size the caches. Each batch's rows are prefetched a batch
ahead; results do not depend on the cache's size.

Several processes (hosts): ``--coordinator-address``, ``--num-processes`` and
``--process-id``, or a launcher JAX detects (``srun``, ``mpirun``; any cluster
with ``--distributed auto``). ``--devices`` then counts every process's devices
(default: all of them); each process reads only its own devices' batches of
the same global stream as a one-process run, metrics and checkpoints are
global, and process 0 alone writes the reports. ``--run-dir`` must be one
directory that every process sees (a shared filesystem across hosts).

From the command line the job first restarts itself with glibc's
``glibc.malloc.hugetlb=1`` (:mod:`jaxrec.cpu.hugepages`): on a CPU its large
tables then lie on huge pages from their first touch, with no collapse stalling
the first step; ``JAXREC_CPU_HUGEPAGES=0`` turns it off.

Steps whose loss or gradients are not finite (a NaN label or feature) are
skipped and counted (``skipped`` on the progress line, ``skipped_steps`` in
the summary; see ``make_train_step(skip_nonfinite=True)``).

Each run writes into a new ``runs/dlrm-<date>-<time>`` unless ``--run-dir``
names one (``--resume`` continues a named run, ``--overwrite`` starts it again).
The run directory gets ``summary.json`` (also printed as the last line, the
only one on stdout), ``metrics.jsonl`` (one line per evaluation), checkpoints
(``--checkpoint-every``), TensorBoard scalars (``--tensorboard``, tensorboardX)
and ``curves.png`` (``--plot``, matplotlib). Progress, with an ETA, goes to
stderr: a bar on a terminal, plain lines otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from ..cache import CachedTrainStep, CacheTooSmallError, prefetching
from ..checkpoint import CheckpointManager
from ..cpu.hugepages import restart_with_huge_pages, started_with_huge_pages
from ..datasets import Part
from ..datasets.movielens import ML100K_FILES, default_cache_dir
from ..distributed import (
    PEER_LOST,
    initialize,
    launched_processes,
    lost_process,
    process_ranks,
    shard_batch,
    stop_watching,
    watch_processes,
)
from ..train import (
    TrainPipeline,
    TrainPipelineSemiSync,
    TrainPipelineSparseDist,
    stack_micro_batches,
)
from .dlrm_cache import (
    cache_summary,
    cached_text,
    check_cache_flags,
    device_tables,
    forced,
    place_tables,
    row_cache,
    slot_view,
)
from .dlrm_dynamic import (
    check_dynamic_flags,
    dynamic_summary,
    dynamic_text,
    ensure_dynamic_buffers,
)
from .dlrm_flags import parse_args
from .dlrm_parts import (
    build_model,
    build_optimizer,
    evaluate,
    evaluate_cached,
    fit_capacities,
    load_data,
    make_steps,
    plan_rows,
    shard,
    table_configs,
)
from .progress import Progress, plan_table
from .run_dir import clear_outputs, new_run_dir, resume_needs_run_dir
from .run_log import ScalarWriter, missing, plot_curves
from .shards import rank_batches


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` (default: the command line, after a restart with huge pages)
    and runs the job. The console script is :func:`jaxrec.jobs.dlrm_cli.main`, which
    parses the flags before JAX loads."""
    if argv is None:  # the command line: large tables on huge pages from the start
        restart_with_huge_pages()
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Runs the job with parsed flags (:func:`jaxrec.jobs.dlrm_flags.parse_args`)."""
    finished = False
    try:
        code = _run(args)
        finished = True
        return code
    except CacheTooSmallError as e:  # a batch's rows do not fit a cached table's slots
        raise SystemExit(
            f"jaxrec-train-dlrm: {e} (here: --cache-load-factor, or a smaller --batch-size)"
        ) from None
    except Exception as e:
        lost = lost_process(e) if jax.distributed.is_initialized() else None
        if lost is None:
            raise
        _stop_lost(lost)  # a collective failed with another process
    finally:
        stop_watching(ok=finished)  # the other processes stop too when this one fails


def _stop_lost(what: str) -> None:
    """Another process died or failed: this one cannot go on. Exits at once (a normal
    exit would wait in JAX's shutdown barrier for it until the heartbeat timeout)."""
    hint = "restart every process with --resume (the run continues from its last checkpoint)"
    if what.endswith("failed with an error"):  # (its own output says which)
        hint = "its output has the error"
    sys.stdout.flush()
    print(f"jaxrec-train-dlrm: error: {what}; {hint}", file=sys.stderr, flush=True)
    os._exit(PEER_LOST)


def _run(args: argparse.Namespace) -> int:
    _start_processes(args)  # before the first array starts JAX's backend
    if jax.process_count() > 1 and args.devices == 1:
        args.devices = jax.device_count()
    lead = jax.process_index() == 0  # the one process that writes reports
    log = Progress(quiet=args.quiet or not lead, units={"loss": "nats"})  # optax's BCE: ln
    _check_run_dir_flags(args)
    _check_run_dir(args)  # read only: a refused command leaves the file system as it was
    check_cache_flags(args)
    check_dynamic_flags(args)
    if args.pipeline == "semi-sync" and args.dynamic_tables:  # ids admitted in the forward
        raise SystemExit("--pipeline semi-sync does not take --dynamic-tables: use sync")
    _check_accumulation_flags(args)
    # Optional libraries: a run without them says once what it skips.
    tensorboard = (
        args.tensorboard
        and lead
        and _available("tensorboardX", "tensorboard", "--tensorboard", log)
    )
    plot = args.plot and lead and _available("matplotlib", "plots", "--plot", log)
    if args.dataset == "movielens" and args.data_dir is None and not _movielens_cached():
        log.note("fetching MovieLens-100k (pip download recbole; once, into the cache)...")
    log.note(f"preparing {args.dataset} data...")
    train_data, eval_data = load_data(args)
    configs = table_configs(args, train_data)
    forced(args, configs)  # names checked before the run's directory is made
    world, k = args.devices, args.grad_accumulation
    per_epoch = _steps_per_epoch(train_data, args)
    mesh, plan, cached, stats = place_tables(args, train_data, configs)
    device_configs, device_plan = device_tables(configs, plan, cached)
    mesh, model, plan_text = shard(
        args, lambda: build_model(args, train_data, device_configs), mesh, device_plan
    )  # sharded: each device draws only its own shards
    ranks = process_ranks(mesh) if mesh is not None else [0]  # the devices this process feeds
    if mesh is not None:
        log.note(f"sharding plan over {args.devices} devices ({args.sharding}):")
        log.note(plan_table(plan_rows(model)))
        view = (lambda kjt: slot_view(kjt, configs, plan, cached)) if cached else None
        if not args.dynamic_tables:  # (a dynamic table's rows are known only in the step)
            fit_capacities(model, train_data, args, view=view)
    if cached:
        log.note(cached_text(configs, cached, stats))
    optimizer = build_optimizer(args)
    if args.dynamic_tables:
        ensure_dynamic_buffers(model, train_data, args)
    graphdef, state, step, eval_step = make_steps(model, optimizer, args)
    rc = (
        row_cache(args, train_data, configs, cached, graphdef, optimizer, state) if cached else None
    )
    to_device = (lambda b: shard_batch(b, mesh)) if mesh is not None else jax.device_put
    if k > 1:  # a step's k micro-batches, each placed as a plain step's, stacked
        one = to_device
        to_device = lambda group: stack_micro_batches([one(b) for b in group])  # noqa: E731
    if rc is not None and k > 1:
        raise SystemExit(f"--grad-accumulation {k} does not take cached tables")
    if rc is not None and args.pipeline != "sync":
        raise SystemExit(f"--pipeline {args.pipeline} does not take cached tables: use sync")
    if rc is not None:  # each batch's rows planned and gathered a batch ahead
        step, to_device = CachedTrainStep(step, rc), prefetching(rc, to_device)
    # Everything that can refuse has been checked: the run writes from here on.
    run_dir = _make_run_dir(args, lead)
    args.run_dir = str(run_dir)  # args.json records where the run is
    log.note(f"run directory: {run_dir}")
    ckpt = None if args.no_checkpoint else _checkpoints(run_dir, args)
    start_step = 0
    if not args.resume and lead:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    if args.resume:  # (_check_run_dir found a checkpoint)
        if rc is not None:  # the host tables restored, the cache empty
            state, start_step = rc.resume(ckpt, state)
        else:
            state, start_step = ckpt.resume(graphdef, optimizer, state)  # newest intact step
        log.note(f"resumed from step {start_step}")
    if lead:  # after the resume: a run whose checkpoints are all damaged keeps its args.json
        _save_args(run_dir, args, train_data)

    total = per_epoch * args.epochs if args.max_steps is None else args.max_steps
    total = min(total, per_epoch * args.epochs)
    finished = _finished_summary(run_dir, start_step) if args.resume else None
    if finished is not None and start_step >= total:  # nothing left: keep its summary
        log.note(f"{run_dir} finished at step {start_step}: its summary is kept")
        if ckpt:
            ckpt.close()
        if rc is not None:
            rc.close()
        if lead:
            print(json.dumps(finished), flush=True)
        return 0
    writer = ScalarWriter(run_dir / "tb") if tensorboard else None
    curves: dict[str, list] = {"train_loss": [], "eval_auc": [], "eval_ne": []}
    history = []
    eval_every = args.eval_every or per_epoch

    pipelines = {"sparse-dist": TrainPipelineSparseDist, "semi-sync": TrainPipelineSemiSync}
    pipeline = pipelines.get(args.pipeline, TrainPipeline)(step, state, to_device=to_device)

    def evaluate_now() -> dict:
        if rc is None:
            return evaluate(eval_step, pipeline.state, eval_data, args, mesh)
        metrics, pipeline.state = evaluate_cached(
            eval_step, pipeline.state, eval_data, args, mesh, rc
        )
        return metrics

    def save(at: int) -> None:
        if rc is None:
            ckpt.save(at, graphdef, optimizer, pipeline.state, force=True)
        else:  # the host tables in the checkpoint (the cache flushed first)
            rc.save(ckpt, at, pipeline.state, force=True)

    jax.block_until_ready(pipeline.state)  # the tables' initialisation is not training
    step_i, samples, t0, losses = start_step, 0, time.perf_counter(), []
    train_time = 0.0
    first_step_s, first_samples = None, 0  # the first step compiles: rates start after it
    if step_i < total:
        log.note(f"training steps {step_i + 1}..{total}; the first compiles the step...")
    log.start(total, initial=start_step)
    saves = args.checkpoint_every if ckpt else 0
    for epoch in itertools.count(start_step // per_epoch):
        if step_i >= total:
            break
        skip = step_i - epoch * per_epoch  # resumed mid-epoch: the same order, minus done batches
        it = _device_batches(train_data, args, epoch, ranks, world, skip * k)
        if k > 1:  # k consecutive micro-batches per step
            it = _groups(it, k)
        while step_i < total:
            # Segments end at each evaluation and checkpoint: the pipeline then holds no
            # batch prefetched past it (a cache has no batch planned but not loaded).
            stop = _next_stop(step_i, total, eval_every, saves)
            for loss in _steps(pipeline, itertools.islice(it, stop - step_i)):
                step_i += 1
                samples += args.batch_size * world * k
                losses.append(loss)
                if step_i == start_step + 1:
                    jax.block_until_ready(loss)
                    first_step_s, first_samples = time.perf_counter() - t0, samples
                if step_i % 10 == 0 or step_i == total or step_i == start_step + 1:
                    skipped = pipeline.skipped_steps()  # non-finite batches, not trained on
                    shown = {"skipped": skipped} if skipped else {}
                    log.update(step_i, samples, loss=float(loss), **shown)
                if step_i % 50 == 0 or step_i == total:
                    mean_loss = float(sum(float(x) for x in losses) / len(losses))
                    curves["train_loss"].append((step_i, mean_loss))
                    if writer:
                        writer.add_scalars({"train/loss": mean_loss}, step_i)
                    losses = []
            if step_i < stop:  # the epoch's batches ran out
                break
            if step_i % eval_every == 0 or step_i == total:
                jax.block_until_ready(pipeline.state)
                train_time += time.perf_counter() - t0
                with log.paused():  # not training: samples/s leaves it out
                    metrics = evaluate_now()
                history.append({"step": step_i, "epoch": epoch, **metrics})
                _record_eval(run_dir, history[-1], curves, writer, lead)
                log.note(f"step {step_i}: eval {_eval_text(metrics)}")
                if args.dynamic_tables:
                    log.note(dynamic_text(dynamic_summary(graphdef, pipeline.state)))
                t0 = time.perf_counter()
            if saves and step_i % saves == 0:
                save(step_i)
        pipeline.close()
    jax.block_until_ready(pipeline.state)
    train_time += time.perf_counter() - t0
    log.close()
    if not history:  # resumed at the last step, with no summary left: evaluate it now
        metrics = evaluate_now()
        history.append({"step": step_i, "epoch": max(step_i - 1, 0) // per_epoch, **metrics})
        _record_eval(run_dir, history[-1], curves, writer, lead)
    if ckpt:
        if ckpt.latest_step() != step_i:
            save(step_i)
        ckpt.wait_until_finished()
        ckpt.close()
    if writer:
        writer.close()
    if plot:
        title = f"{args.model} on {args.dataset} ({run_dir.name})"
        plot_curves(curves, title, run_dir / "curves.png")
    summary = {
        "model": args.model,
        "dataset": args.dataset,
        "devices": world,
        "processes": jax.process_count(),
        "sharding": plan_text,
        "steps": step_i,
        "samples": samples,
        # Steady state, as the progress lines: the first step (compiling) left out.
        "samples_per_s": _rate(samples - first_samples, train_time - (first_step_s or 0.0)),
        "train_seconds": round(train_time, 2),  # every step's, evaluations left out
        "first_step_seconds": None if first_step_s is None else round(first_step_s, 2),
        "skipped_steps": pipeline.skipped_steps(),  # non-finite loss/gradients: not applied
        "huge_pages": started_with_huge_pages(),  # glibc.malloc.hugetlb (the CLI's restart)
        **({} if rc is None else {"cached_tables": cache_summary(rc, stats)}),
        **(
            {"dynamic_tables": dynamic_summary(graphdef, pipeline.state)}
            if args.dynamic_tables
            else {}
        ),
        "eval": history[-1],
        **train_data.reference_metrics(eval_data),
    }
    if rc is not None:
        rc.close()
    if lead:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary), flush=True)
    return 0


def _rate(samples: int, seconds: float) -> float | None:
    """samples/s, or None without samples to time (a run of one step: all compiling)."""
    return round(samples / max(seconds, 1e-9), 1) if samples else None


# Units of the printed metrics: TorchRec's log loss is in bits (log2), the training
# loss in nats (ln); NE, the ratio of two log losses, has none.
METRIC_UNITS = {"logloss": "bits"}


def _eval_text(metrics: dict) -> str:
    """``auc 0.7712, ne 0.8123, logloss 0.6543 bits, ...``."""
    return ", ".join(
        f"{k} {v:.4f}" + (f" {METRIC_UNITS[k]}" if k in METRIC_UNITS else "")
        for k, v in metrics.items()
    )


def _check_accumulation_flags(args: argparse.Namespace) -> None:
    k = args.grad_accumulation
    if k < 1:
        raise SystemExit(f"--grad-accumulation must be at least 1, got {k}")
    if k == 1:
        return
    if args.pipeline != "sync":
        raise SystemExit(f"--grad-accumulation {k} trains with --pipeline sync only")
    if args.dynamic_tables:  # a later micro-batch may evict a row an earlier one trained
        raise SystemExit(f"--grad-accumulation {k} does not take --dynamic-tables")
    if args.cache_tables:  # the cache plans rows per batch (the planner's, checked later)
        raise SystemExit(f"--grad-accumulation {k} does not take cached tables")


def _groups(batches: Iterator, k: int) -> Iterator[list]:
    """``k`` consecutive batches at a time (a partial group at the end is left out)."""
    while len(group := list(itertools.islice(batches, k))) == k:
        yield group


def _steps(pipeline: TrainPipeline, batches: Iterator) -> Iterator:
    """The pipeline's losses over ``batches``, one step each, until they run out."""
    while True:
        try:
            yield pipeline.progress(batches)[0]
        except StopIteration:
            return


def _next_stop(step: int, total: int, eval_every: int, save_every: int) -> int:
    """The next step after ``step`` that evaluates, checkpoints or ends the run."""
    stops = [total, (step // eval_every + 1) * eval_every]
    if save_every:
        stops.append((step // save_every + 1) * save_every)
    return min(stops)


def _check_run_dir_flags(args: argparse.Namespace) -> None:
    """Fails early (before any data is read) on ``--run-dir`` flags that cannot work."""
    if args.resume and args.overwrite:
        raise SystemExit("--resume continues a run and --overwrite starts it again: pass one")
    if args.resume and args.no_checkpoint:
        raise SystemExit("--resume starts from a checkpoint: drop --no-checkpoint")
    if args.run_dir is None:
        if args.resume:
            raise SystemExit(resume_needs_run_dir())
        if args.overwrite:
            raise SystemExit("--overwrite needs --run-dir (without one each run gets a new one)")
        if jax.process_count() > 1:  # each process would make its own directory
            raise SystemExit("several processes write one run: pass --run-dir, a directory "
                             "every process sees")  # fmt: skip


def _check_run_dir(args: argparse.Namespace) -> None:
    """Refuses a ``--run-dir`` whose checkpoints do not fit the flags (a fresh run into
    a run's checkpoints, ``--resume`` with none), reading it and writing nothing."""
    if args.run_dir is None or args.overwrite:
        return
    run_dir = Path(args.run_dir)
    latest = None
    if (run_dir / "checkpoints").is_dir():  # (a CheckpointManager creates its directory)
        ckpt = _checkpoints(run_dir, args)
        latest = ckpt.latest_step()
        ckpt.close()
    if args.resume and latest is None:
        raise SystemExit(f"--resume: no checkpoint under {run_dir / 'checkpoints'}")
    if not args.resume and not args.no_checkpoint and latest is not None:
        raise SystemExit(
            f"{run_dir} already holds checkpoints (latest step {latest}): "
            "pass --resume to continue that run, --overwrite to start it again, "
            "or leave out --run-dir for a new one"
        )


def _steps_per_epoch(train_data, args: argparse.Namespace) -> int:
    """Optimizer steps per epoch (``k`` micro-batches each; a partial group is left out);
    refuses data too small for one."""
    world, k = args.devices, args.grad_accumulation
    per_epoch = train_data.num_batches(args.batch_size * world, part=Part(0, 1))
    per_epoch //= k
    if per_epoch == 0:  # nothing to step on (and the epoch arithmetic divides by it)
        batches = "one global batch" if k == 1 else f"one step of {k} global batches"
        raise SystemExit(
            f"{train_data.num_rows} training rows: fewer than {batches} of "
            f"{args.batch_size * world} (--batch-size {args.batch_size} x {world} devices"
            f"{'' if k == 1 else f', --grad-accumulation {k}'}); use a smaller --batch-size "
            "or more data"
        )
    return per_epoch


def _make_run_dir(args: argparse.Namespace, lead: bool) -> Path:
    """The run's directory, created: ``--run-dir`` (cleared first with ``--overwrite``)
    or a new ``runs/dlrm-<date>-<time>``."""
    if args.run_dir is None:
        return new_run_dir()
    run_dir = Path(args.run_dir)
    if args.overwrite and lead:
        clear_outputs(run_dir)
    if args.overwrite and jax.process_count() > 1:  # no process reads it before it is cleared
        multihost_utils.sync_global_devices("jaxrec-train-dlrm --overwrite")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _available(module: str, extra: str, flag: str, log: Progress) -> bool:
    why = missing(module, extra, flag)
    if why:
        log.warn(why)
    return why is None


def _movielens_cached() -> bool:
    return all((default_cache_dir() / "ml-100k" / f).exists() for f in ML100K_FILES)


def _finished_summary(run_dir: Path, step: int) -> dict | None:
    """The summary a finished run left, if it ended at ``step`` with an evaluation."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    return summary if summary.get("steps") == step and "eval" in summary else None


def _record_eval(run_dir: Path, entry: dict, curves: dict, writer, lead: bool) -> None:
    """One evaluation into metrics.jsonl, the plot's curves and TensorBoard."""
    if lead:
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
    curves["eval_auc"].append((entry["step"], entry["auc"]))
    curves["eval_ne"].append((entry["step"], entry["ne"]))
    if writer:
        scalars = {f"eval/{k}": v for k, v in entry.items() if k not in ("step", "epoch")}
        writer.add_scalars(scalars, entry["step"])


def _start_processes(args: argparse.Namespace) -> None:
    """Starts JAX's distributed runtime when the flags or a launcher ask for several
    processes (``--distributed``), then sets the CPU device count; both must run
    before JAX's backend starts. Bad flags fail here, before any process connects."""
    flags = (args.coordinator_address, args.num_processes, args.process_id)
    if args.distributed == "off" and flags != (None, None, None):
        raise SystemExit(
            "--distributed off runs one process: drop --coordinator-address, "
            "--num-processes and --process-id"
        )
    off, auto = args.distributed == "off", args.distributed == "auto"
    # The process count if known before the backend starts (None: auto, unknown yet).
    processes = 1 if off else args.num_processes or launched_processes() or (None if auto else 1)
    if processes and args.devices != 1 and args.devices % processes:
        raise SystemExit(
            f"--devices {args.devices} cannot be split evenly over {processes} processes: "
            f"use a multiple of {processes}"
        )
    if not off:
        try:
            started = initialize(*flags, auto=auto, heartbeat_timeout_s=args.heartbeat_timeout)
        except ValueError as e:  # name the flags, not the function's arguments
            text = str(e)
            for name in ("coordinator_address", "num_processes", "process_id"):
                text = text.replace(name, "--" + name.replace("_", "-"))
            text = text.replace("heartbeat_timeout_s", "--heartbeat-timeout")
            raise SystemExit(f"jaxrec-train-dlrm: {text}") from None
        if started:  # a process that dies stops the others at once, naming it
            watch_processes(lambda i, address, how: _stop_lost(f"process {i} ({address}) {how}"))
    if processes and (processes == 1 or args.devices != 1):  # else every device (see main)
        _cpu_devices(args.devices // processes)


def _cpu_devices(n: int) -> None:
    """On a CPU host, ``n`` fake devices in this process."""
    if n > 1 and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # RuntimeError: the backend already started (e.g. inside tests).
        with contextlib.suppress(RuntimeError):
            jax.config.update("jax_num_cpu_devices", n)


def _device_batches(data, args, epoch: int, ranks: list[int], world: int, skip: int) -> Iterator:
    """Host batches for the pipeline: one per step, or a list of this process's
    devices' batches (``ranks`` of ``world``)."""
    groups = rank_batches(
        data, args.batch_size, ranks, world, shuffle=True, seed=args.seed, epoch=epoch
    )
    if world == 1:
        groups = (group[0] for group in groups)
    return itertools.islice(groups, skip, None)


def _save_args(run_dir: Path, args: argparse.Namespace, data) -> None:
    """``run_dir/args.json``: the flags and data sizes that rebuild this run's model
    (read by ``jaxrec.jobs.from_run.model_from_run``)."""
    info = {
        "args": vars(args),
        "data": {
            "keys": list(data.keys),
            "num_embeddings_per_feature": [int(n) for n in data.num_embeddings_per_feature],
            "num_dense": int(data.num_dense),
            "max_ids_per_sample": [int(n) for n in data.max_ids_per_sample],
        },
    }
    (run_dir / "args.json").write_text(json.dumps(info, indent=1))


def _checkpoints(run_dir: Path, args):
    return CheckpointManager(run_dir / "checkpoints", max_to_keep=args.keep_checkpoints)


if __name__ == "__main__":
    raise SystemExit(main())
