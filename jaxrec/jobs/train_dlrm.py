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

import contextlib
import dataclasses
import functools
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, NoReturn

import jax
from flax import nnx
from jax.experimental import multihost_utils

from ..cache import CacheTooSmallError
from ..checkpoint import CheckpointManager
from ..configs import EmbeddingBagConfig
from ..cpu.hugepages import restart_with_huge_pages, started_with_huge_pages
from ..datasets import Part, TableDataset
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
    TrainState,
    TrainStep,
    stack_micro_batches,
)
from .dlrm_cache import (
    cached_text,
    check_cache_flags,
    device_tables,
    forced,
    place_tables,
    row_cache,
    slot_view,
)
from .dlrm_config import DlrmJobConfig
from .dlrm_dynamic import (
    check_dynamic_flags,
    dynamic_summary,
    dynamic_text,
    ensure_dynamic_buffers,
)
from .dlrm_flags import parse_args as parse_args
from .dlrm_flags import parse_config
from .dlrm_parts import (
    EvalStep,
    build_model,
    build_optimizer,
    fit_capacities,
    load_data,
    make_steps,
    plan_rows,
    shard,
    table_configs,
)
from .dlrm_tables import CachedTables, DeviceTables, Tables, ToDevice
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
    return run(parse_config(argv))


def run(config: DlrmJobConfig) -> int:
    """Runs the job with parsed flags (:func:`jaxrec.jobs.dlrm_flags.parse_config`)."""
    finished = False
    try:
        code = _run(config)
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


def _stop_lost(what: str) -> NoReturn:
    """Another process died or failed: this one cannot go on. Exits at once (a normal
    exit would wait in JAX's shutdown barrier for it until the heartbeat timeout)."""
    hint = "restart every process with --resume (the run continues from its last checkpoint)"
    if what.endswith("failed with an error"):  # (its own output says which)
        hint = "its output has the error"
    sys.stdout.flush()
    print(f"jaxrec-train-dlrm: error: {what}; {hint}", file=sys.stderr, flush=True)
    os._exit(PEER_LOST)


def _run(config: DlrmJobConfig) -> int:
    _start_processes(config)  # before the first array starts JAX's backend
    config = _with_all_devices(config)
    lead = jax.process_index() == 0  # the one process that writes reports
    log = Progress(quiet=config.quiet or not lead, units={"loss": "nats"})  # optax's BCE: ln
    _check_flags(config)  # read only: a refused command leaves the file system as it was
    reports = _Reports.wanted(config, lead, log)  # optional libraries: says what it skips
    data = _open_data(config, log)
    job = _build(config, data, log)
    # Everything that can refuse has been checked: the run writes from here on.
    made = str(_make_run_dir(config, lead))
    config = dataclasses.replace(config, run_dir=made)  # args.json records where the run is
    run_dir = Path(made)
    log.note(f"run directory: {run_dir}")
    ckpt = None if config.no_checkpoint else _checkpoints(run_dir, config)
    state, start_step = _restore(config, job, ckpt, run_dir, lead, log)
    if lead:  # after the resume: a run whose checkpoints are all damaged keeps its args.json
        _save_args(run_dir, config, data.train)
    total = _total_steps(config, data.per_epoch)
    finished = _finished_summary(run_dir, start_step) if config.resume else None
    if finished is not None and start_step >= total:  # nothing left: keep its summary
        log.note(f"{run_dir} finished at step {start_step}: its summary is kept")
        _close(ckpt, job.tables)
        if lead:
            print(json.dumps(finished), flush=True)
        return 0
    reports.open(run_dir)
    pipelines = {"sparse-dist": TrainPipelineSparseDist, "semi-sync": TrainPipelineSemiSync}
    pipeline = pipelines.get(config.pipeline, TrainPipeline)(
        job.step, state, to_device=job.to_device
    )
    trained = _train(config, data, job, pipeline, reports, ckpt, log, start_step, total)
    summary = _finish(config, data, job, pipeline, reports, ckpt, trained)
    job.tables.close()
    if lead:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary), flush=True)
    return 0


def _with_all_devices(config: DlrmJobConfig) -> DlrmJobConfig:
    """With several processes, ``--devices`` left at 1 means every process's devices."""
    if jax.process_count() > 1 and config.devices == 1:
        return dataclasses.replace(config, devices=jax.device_count())
    return config


def _total_steps(config: DlrmJobConfig, per_epoch: int) -> int:
    """The step the run ends at: ``--max-steps``, at most ``--epochs``' worth."""
    total = per_epoch * config.epochs if config.max_steps is None else config.max_steps
    return min(total, per_epoch * config.epochs)


def _check_flags(config: DlrmJobConfig) -> None:
    """Refuses flags that cannot work together, and a ``--run-dir`` they do not fit,
    before any data is read (reading the run's directory, writing nothing)."""
    _check_run_dir_flags(config)
    _check_run_dir(config)
    check_cache_flags(config)
    check_dynamic_flags(config)
    if config.pipeline == "semi-sync" and config.dynamic_tables:  # ids admitted in the forward
        raise SystemExit("--pipeline semi-sync does not take --dynamic-tables: use sync")
    _check_accumulation_flags(config)


class _Data(NamedTuple):
    """The run's data: its datasets, logical tables and optimizer steps per epoch."""

    train: TableDataset
    eval: TableDataset
    tables: list[EmbeddingBagConfig]
    per_epoch: int


def _open_data(config: DlrmJobConfig, log: Progress) -> _Data:
    """The datasets and their tables; refuses ``--cache-tables`` names no table has and
    data too small for one step (before the run's directory is made)."""
    if config.dataset == "movielens" and config.data_dir is None and not _movielens_cached():
        log.note("fetching MovieLens-100k (pip download recbole; once, into the cache)...")
    log.note(f"preparing {config.dataset} data...")
    train_data, eval_data = load_data(config)
    tables = table_configs(config, train_data)
    forced(config, tables)  # names checked before the run's directory is made
    return _Data(train_data, eval_data, tables, _steps_per_epoch(train_data, config))


class _Job(NamedTuple):
    """The model built for training: its placement, steps and initial train state."""

    mesh: jax.sharding.Mesh | None
    ranks: list[int]  # the devices this process feeds
    plan_text: str  # the sharding types, for the summary
    graphdef: nnx.GraphDef
    state: TrainState
    step: TrainStep
    eval_step: EvalStep
    to_device: ToDevice  # host batch (or a step's micro-batches) -> device batch
    tables: Tables


def _build(config: DlrmJobConfig, data: _Data, log: Progress) -> _Job:
    """Places the tables (the plan; which are cached), builds the model sharded, its
    optimizer and steps."""
    configs = data.tables
    mesh, plan, cached, stats = place_tables(config, data.train, configs)
    device_configs, device_plan = device_tables(configs, plan, cached)
    mesh, model, plan_text = shard(
        config, lambda: build_model(config, data.train, device_configs), mesh, device_plan
    )  # sharded: each device draws only its own shards
    ranks = process_ranks(mesh) if mesh is not None else [0]  # the devices this process feeds
    if mesh is not None:
        log.note(f"sharding plan over {config.devices} devices ({config.sharding}):")
        log.note(plan_table(plan_rows(model)))
        view = None
        if cached:
            if plan is None:  # (place_tables plans every run over several devices)
                raise RuntimeError("cached tables over several devices need a plan")
            view = functools.partial(slot_view, configs=configs, plan=plan, cached=cached)
        if not config.dynamic_tables:  # (a dynamic table's rows are known only in the step)
            fit_capacities(model, data.train, config, view=view)
    if cached:
        log.note(cached_text(configs, cached, stats))
    optimizer = build_optimizer(config)
    if config.dynamic_tables:
        ensure_dynamic_buffers(model, data.train, config)
    graphdef, state, step, eval_step = make_steps(model, optimizer, config)
    tables: Tables = DeviceTables(graphdef, optimizer)
    if cached:  # each batch's rows planned and gathered a batch ahead
        rc = row_cache(config, data.train, configs, cached, graphdef, optimizer, state)
        tables = CachedTables(rc, stats, config)
    step, to_device = tables.wrap(step, _to_device(mesh, config.grad_accumulation))
    return _Job(mesh, ranks, plan_text, graphdef, state, step, eval_step, to_device, tables)


def _to_device(mesh: jax.sharding.Mesh | None, k: int) -> ToDevice:
    """Host batch -> device batch; with ``k > 1``, a step's ``k`` micro-batches, each
    placed as a plain step's, stacked."""
    one = (lambda b: shard_batch(b, mesh)) if mesh is not None else jax.device_put
    if k == 1:
        return one
    return lambda group: stack_micro_batches([one(b) for b in group])


def _restore(
    config: DlrmJobConfig,
    job: _Job,
    ckpt: CheckpointManager | None,
    run_dir: Path,
    lead: bool,
    log: Progress,
) -> tuple[TrainState, int]:
    """``(train state, step)`` to start from: the newest intact checkpoint with
    ``--resume`` (``_check_flags`` found one), else the initial state at step 0."""
    if not config.resume:
        if lead:
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        return job.state, 0
    if ckpt is None:  # (_check_run_dir_flags refuses it)
        raise SystemExit("--resume starts from a checkpoint: drop --no-checkpoint")
    state, start_step = job.tables.resume(ckpt, job.state)  # newest intact step
    log.note(f"resumed from step {start_step}")
    return state, start_step


class _Trained(NamedTuple):
    """What the training loop did, for the summary."""

    steps: int  # the step reached
    samples: int
    train_seconds: float  # every step's, evaluations left out
    first_step_s: float | None  # the first step (compiling); None: no step ran
    first_samples: int


def _train(
    config: DlrmJobConfig,
    data: _Data,
    job: _Job,
    pipeline: TrainPipeline,
    reports: _Reports,
    ckpt: CheckpointManager | None,
    log: Progress,
    start_step: int,
    total: int,
) -> _Trained:
    """Trains from ``start_step`` to ``total``, evaluating every ``--eval-every`` steps
    (default: each epoch) and checkpointing every ``--checkpoint-every``."""
    world, k, per_epoch = config.devices, config.grad_accumulation, data.per_epoch
    eval_every = config.eval_every or per_epoch
    jax.block_until_ready(pipeline.state)  # the tables' initialisation is not training
    step_i, samples, t0, losses = start_step, 0, time.perf_counter(), []
    train_time = 0.0
    first_step_s, first_samples = None, 0  # the first step compiles: rates start after it
    if step_i < total:
        log.note(f"training steps {step_i + 1}..{total}; the first compiles the step...")
    log.start(total, initial=start_step)
    saves = config.checkpoint_every if ckpt else 0
    for epoch in itertools.count(start_step // per_epoch):
        if step_i >= total:
            break
        skip = step_i - epoch * per_epoch  # resumed mid-epoch: the same order, minus done batches
        it = _device_batches(data.train, config, epoch, job.ranks, world, skip * k)
        if k > 1:  # k consecutive micro-batches per step
            it = _groups(it, k)
        while step_i < total:
            # Segments end at each evaluation and checkpoint: the pipeline then holds no
            # batch prefetched past it (a cache has no batch planned but not loaded).
            stop = _next_stop(step_i, total, eval_every, saves)
            for loss in _steps(pipeline, itertools.islice(it, stop - step_i)):
                step_i += 1
                samples += config.batch_size * world * k
                losses.append(loss)
                if step_i == start_step + 1:
                    jax.block_until_ready(loss)
                    first_step_s, first_samples = time.perf_counter() - t0, samples
                if step_i % 10 == 0 or step_i == total or step_i == start_step + 1:
                    skipped = pipeline.skipped_steps()  # non-finite batches, not trained on
                    shown = {"skipped": skipped} if skipped else {}
                    log.update(step_i, samples, loss=float(loss), **shown)
                if step_i % 50 == 0 or step_i == total:
                    reports.train_loss(step_i, float(sum(float(x) for x in losses) / len(losses)))
                    losses = []
            if step_i < stop:  # the epoch's batches ran out
                break
            if step_i % eval_every == 0 or step_i == total:
                jax.block_until_ready(pipeline.state)
                train_time += time.perf_counter() - t0
                with log.paused():  # not training: samples/s leaves it out
                    metrics = _evaluate(config, data, job, pipeline)
                reports.eval({"step": step_i, "epoch": epoch, **metrics})
                log.note(f"step {step_i}: eval {_eval_text(metrics)}")
                if config.dynamic_tables:
                    log.note(dynamic_text(dynamic_summary(job.graphdef, pipeline.state)))
                t0 = time.perf_counter()
            if saves and ckpt is not None and step_i % saves == 0:
                job.tables.save(ckpt, step_i, pipeline.state)
        pipeline.close()
    jax.block_until_ready(pipeline.state)
    train_time += time.perf_counter() - t0
    log.close()
    return _Trained(step_i, samples, train_time, first_step_s, first_samples)


def _evaluate(config: DlrmJobConfig, data: _Data, job: _Job, pipeline: TrainPipeline) -> dict:
    """The metrics of the pipeline's state on the eval set (call with no batch in flight)."""
    metrics, pipeline.state = job.tables.evaluate(
        job.eval_step, pipeline.state, data.eval, config, job.mesh
    )
    return metrics


def _finish(
    config: DlrmJobConfig,
    data: _Data,
    job: _Job,
    pipeline: TrainPipeline,
    reports: _Reports,
    ckpt: CheckpointManager | None,
    trained: _Trained,
) -> dict:
    """Evaluates a run that has no evaluation yet, saves the last checkpoint, closes the
    reports; returns the summary."""
    step_i = trained.steps
    if not reports.history:  # resumed at the last step, with no summary left: evaluate it now
        metrics = _evaluate(config, data, job, pipeline)
        epoch = max(step_i - 1, 0) // data.per_epoch
        reports.eval({"step": step_i, "epoch": epoch, **metrics})
    if ckpt:
        if ckpt.latest_step() != step_i:
            job.tables.save(ckpt, step_i, pipeline.state)
        ckpt.wait_until_finished()
        ckpt.close()
    reports.close(f"{config.model} on {config.dataset}")
    train_time, first_step_s = trained.train_seconds, trained.first_step_s
    return {
        "model": config.model,
        "dataset": config.dataset,
        "devices": config.devices,
        "processes": jax.process_count(),
        "sharding": job.plan_text,
        "steps": step_i,
        "samples": trained.samples,
        # Steady state, as the progress lines: the first step (compiling) left out.
        "samples_per_s": _rate(
            trained.samples - trained.first_samples, train_time - (first_step_s or 0.0)
        ),
        "train_seconds": round(train_time, 2),  # every step's, evaluations left out
        "first_step_seconds": None if first_step_s is None else round(first_step_s, 2),
        "skipped_steps": pipeline.skipped_steps(),  # non-finite loss/gradients: not applied
        "huge_pages": started_with_huge_pages(),  # glibc.malloc.hugetlb (the CLI's restart)
        **job.tables.summary(),
        **(
            {"dynamic_tables": dynamic_summary(job.graphdef, pipeline.state)}
            if config.dynamic_tables
            else {}
        ),
        "eval": reports.history[-1],
        **data.train.reference_metrics(data.eval),
    }


def _close(ckpt: CheckpointManager | None, tables: Tables) -> None:
    if ckpt:
        ckpt.close()
    tables.close()


class _Reports:
    """The run's reports besides the summary: ``metrics.jsonl`` (the lead process),
    the curves of ``--plot`` and TensorBoard's scalars (``--tensorboard``)."""

    def __init__(self, lead: bool, tensorboard: bool, plot: bool):
        self.lead, self.tensorboard, self.plot = lead, tensorboard, plot
        self.run_dir: Path | None = None  # set once made
        self.writer: ScalarWriter | None = None
        self.curves: dict[str, list] = {"train_loss": [], "eval_auc": [], "eval_ne": []}
        self.history: list[dict] = []  # every evaluation

    @classmethod
    def wanted(cls, config: DlrmJobConfig, lead: bool, log: Progress) -> _Reports:
        """The reports the flags ask for and the optional libraries allow (a run without
        them says once what it skips)."""
        tensorboard = (
            config.tensorboard
            and lead
            and _available("tensorboardX", "tensorboard", "--tensorboard", log)
        )
        plot = config.plot and lead and _available("matplotlib", "plots", "--plot", log)
        return cls(lead, bool(tensorboard), bool(plot))

    def open(self, run_dir: Path) -> None:
        """Writes into ``run_dir``; opens TensorBoard's writer there (when asked for)."""
        self.run_dir = run_dir
        self.writer = ScalarWriter(self.run_dir / "tb") if self.tensorboard else None

    def _dir(self) -> Path:
        if self.run_dir is None:
            raise RuntimeError("_Reports.open(run_dir) comes before the reports")
        return self.run_dir

    def train_loss(self, step: int, mean_loss: float) -> None:
        self.curves["train_loss"].append((step, mean_loss))
        if self.writer:
            self.writer.add_scalars({"train/loss": mean_loss}, step)

    def eval(self, entry: dict) -> None:
        """One evaluation into the history, metrics.jsonl, the curves and TensorBoard."""
        self.history.append(entry)
        if self.lead:
            with open(self._dir() / "metrics.jsonl", "a") as f:
                f.write(json.dumps(entry) + "\n")
        self.curves["eval_auc"].append((entry["step"], entry["auc"]))
        self.curves["eval_ne"].append((entry["step"], entry["ne"]))
        if self.writer:
            scalars = {f"eval/{k}": v for k, v in entry.items() if k not in ("step", "epoch")}
            self.writer.add_scalars(scalars, entry["step"])

    def close(self, title: str) -> None:
        """Closes TensorBoard's writer and plots the curves (``--plot``)."""
        if self.writer:
            self.writer.close()
        if self.plot:
            run_dir = self._dir()
            plot_curves(self.curves, f"{title} ({run_dir.name})", run_dir / "curves.png")


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


def _check_accumulation_flags(config: DlrmJobConfig) -> None:
    k = config.grad_accumulation
    if k < 1:
        raise SystemExit(f"--grad-accumulation must be at least 1, got {k}")
    if k == 1:
        return
    if config.pipeline != "sync":
        raise SystemExit(f"--grad-accumulation {k} trains with --pipeline sync only")
    if config.dynamic_tables:  # a later micro-batch may evict a row an earlier one trained
        raise SystemExit(f"--grad-accumulation {k} does not take --dynamic-tables")
    if config.cache_tables:  # the cache plans rows per batch (the planner's, checked later)
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


def _check_run_dir_flags(config: DlrmJobConfig) -> None:
    """Fails early (before any data is read) on ``--run-dir`` flags that cannot work."""
    if config.resume and config.overwrite:
        raise SystemExit("--resume continues a run and --overwrite starts it again: pass one")
    if config.resume and config.no_checkpoint:
        raise SystemExit("--resume starts from a checkpoint: drop --no-checkpoint")
    if config.run_dir is None:
        if config.resume:
            raise SystemExit(resume_needs_run_dir())
        if config.overwrite:
            raise SystemExit("--overwrite needs --run-dir (without one each run gets a new one)")
        if jax.process_count() > 1:  # each process would make its own directory
            raise SystemExit(
                "several processes write one run: pass --run-dir, a directory every process sees"
            )


def _check_run_dir(config: DlrmJobConfig) -> None:
    """Refuses a ``--run-dir`` whose checkpoints do not fit the flags (a fresh run into
    a run's checkpoints, ``--resume`` with none), reading it and writing nothing."""
    if config.run_dir is None or config.overwrite:
        return
    run_dir = Path(config.run_dir)
    latest = None
    if (run_dir / "checkpoints").is_dir():  # (a CheckpointManager creates its directory)
        ckpt = _checkpoints(run_dir, config)
        latest = ckpt.latest_step()
        ckpt.close()
    if config.resume and latest is None:
        raise SystemExit(f"--resume: no checkpoint under {run_dir / 'checkpoints'}")
    if not config.resume and not config.no_checkpoint and latest is not None:
        raise SystemExit(
            f"{run_dir} already holds checkpoints (latest step {latest}): "
            "pass --resume to continue that run, --overwrite to start it again, "
            "or leave out --run-dir for a new one"
        )


def _steps_per_epoch(train_data: TableDataset, config: DlrmJobConfig) -> int:
    """Optimizer steps per epoch (``k`` micro-batches each; a partial group is left out);
    refuses data too small for one."""
    world, k = config.devices, config.grad_accumulation
    per_epoch = train_data.num_batches(config.batch_size * world, part=Part(0, 1))
    per_epoch //= k
    if per_epoch == 0:  # nothing to step on (and the epoch arithmetic divides by it)
        batches = "one global batch" if k == 1 else f"one step of {k} global batches"
        raise SystemExit(
            f"{train_data.num_rows} training rows: fewer than {batches} of "
            f"{config.batch_size * world} (--batch-size {config.batch_size} x {world} devices"
            f"{'' if k == 1 else f', --grad-accumulation {k}'}); use a smaller --batch-size "
            "or more data"
        )
    return per_epoch


def _make_run_dir(config: DlrmJobConfig, lead: bool) -> Path:
    """The run's directory, created: ``--run-dir`` (cleared first with ``--overwrite``)
    or a new ``runs/dlrm-<date>-<time>``."""
    if config.run_dir is None:
        return new_run_dir()
    run_dir = Path(config.run_dir)
    if config.overwrite and lead:
        clear_outputs(run_dir)
    if config.overwrite and jax.process_count() > 1:  # no process reads it before it is cleared
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


def _start_processes(config: DlrmJobConfig) -> None:
    """Starts JAX's distributed runtime when the flags or a launcher ask for several
    processes (``--distributed``), then sets the CPU device count; both must run
    before JAX's backend starts. Bad flags fail here, before any process connects."""
    flags = (config.coordinator_address, config.num_processes, config.process_id)
    if config.distributed == "off" and flags != (None, None, None):
        raise SystemExit(
            "--distributed off runs one process: drop --coordinator-address, "
            "--num-processes and --process-id"
        )
    off, auto = config.distributed == "off", config.distributed == "auto"
    # The process count if known before the backend starts (None: auto, unknown yet).
    processes = 1 if off else config.num_processes or launched_processes() or (None if auto else 1)
    if processes and config.devices != 1 and config.devices % processes:
        raise SystemExit(
            f"--devices {config.devices} cannot be split evenly over {processes} processes: "
            f"use a multiple of {processes}"
        )
    if not off:
        try:
            started = initialize(*flags, auto=auto, heartbeat_timeout_s=config.heartbeat_timeout)
        except ValueError as e:  # name the flags, not the function's arguments
            text = str(e)
            for name in ("coordinator_address", "num_processes", "process_id"):
                text = text.replace(name, "--" + name.replace("_", "-"))
            text = text.replace("heartbeat_timeout_s", "--heartbeat-timeout")
            raise SystemExit(f"jaxrec-train-dlrm: {text}") from None
        if started:  # a process that dies stops the others at once, naming it
            watch_processes(lambda i, address, how: _stop_lost(f"process {i} ({address}) {how}"))
    if processes and (processes == 1 or config.devices != 1):  # else every device (see main)
        _cpu_devices(config.devices // processes)


def _cpu_devices(n: int) -> None:
    """On a CPU host, ``n`` fake devices in this process."""
    if n > 1 and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # RuntimeError: the backend already started (e.g. inside tests).
        with contextlib.suppress(RuntimeError):
            jax.config.update("jax_num_cpu_devices", n)


def _device_batches(
    data: TableDataset, config: DlrmJobConfig, epoch: int, ranks: list[int], world: int, skip: int
) -> Iterator:
    """Host batches for the pipeline: one per step, or a list of this process's
    devices' batches (``ranks`` of ``world``)."""
    groups = rank_batches(
        data, config.batch_size, ranks, world, shuffle=True, seed=config.seed, epoch=epoch
    )
    if world == 1:
        groups = (group[0] for group in groups)
    return itertools.islice(groups, skip, None)


def _save_args(run_dir: Path, config: DlrmJobConfig, data: TableDataset) -> None:
    """``run_dir/args.json``: the flags and data sizes that rebuild this run's model
    (read by ``jaxrec.jobs.from_run.model_from_run``)."""
    info = {
        "args": config.as_json(),
        "data": {
            "keys": list(data.keys),
            "num_embeddings_per_feature": [int(n) for n in data.num_embeddings_per_feature],
            "num_dense": int(data.num_dense),
            "max_ids_per_sample": [int(n) for n in data.max_ids_per_sample],
        },
    }
    (run_dir / "args.json").write_text(json.dumps(info, indent=1))


def _checkpoints(run_dir: Path, config: DlrmJobConfig) -> CheckpointManager:
    return CheckpointManager(run_dir / "checkpoints", max_to_keep=config.keep_checkpoints)


if __name__ == "__main__":
    raise SystemExit(main())
