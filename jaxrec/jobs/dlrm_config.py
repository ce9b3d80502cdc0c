"""``jaxrec-train-dlrm``'s flags as one frozen record, what the job's parts take.

:func:`jaxrec.jobs.dlrm_flags.parse_config` parses the command line into a
:class:`DlrmJobConfig`; the flags' defaults and help live in ``dlrm_flags``
only (this record has no defaults, so the two cannot drift apart). Values the
job derives at run time (the device count of several processes, the run's
directory) go into a new record with :func:`dataclasses.replace`, never by
mutation. Light: imports no JAX, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any, Literal


@dataclasses.dataclass(frozen=True, kw_only=True)
class DlrmJobConfig:
    """The job's flags (``jaxrec-train-dlrm --help`` says what each means), in the
    parser's order: ``args.json`` writes them so."""

    # data
    dataset: Literal["synthetic", "criteo", "movielens"]
    data_dir: str | None
    num_train: int
    num_eval: int
    num_embeddings: int
    multi_hot: str | None  # N or "mlperf"
    skip_malformed: bool
    # model
    model: Literal["dlrm", "dcn"]
    embedding_dim: int
    dense_arch: str  # comma-separated layer sizes
    over_arch: str
    dcn_layers: int
    dcn_rank: int
    # training
    batch_size: int  # per device
    epochs: int
    max_steps: int | None
    dense_lr: float
    sparse_lr: float
    seed: int
    eval_every: int
    pipeline: Literal["sync", "sparse-dist", "semi-sync"]
    grad_accumulation: int
    # devices
    devices: int  # every process's together
    sharding: str  # one of dlrm_flags.SHARDINGS
    qcomms: Literal["fp32", "fp16", "bf16"]
    # host memory
    hbm_gib: float | None
    cache_tables: str | None
    cache_load_factor: float
    cache_algorithm: Literal["lru", "lfu"]
    cache_slot_maps: Literal["device", "host"] | None
    cache_scale_up: bool
    cache_statistics_batches: int
    # dynamic tables
    dynamic_tables: int  # slots; 0: off
    dynamic_ways: int
    dynamic_eviction: Literal["lru", "lfu", "ttl"]
    dynamic_ttl: int
    dynamic_admission: int
    # processes
    distributed: Literal["env", "auto", "off"]
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    heartbeat_timeout: int
    # outputs
    run_dir: str | None
    overwrite: bool
    resume: bool
    checkpoint_every: int
    keep_checkpoints: int
    no_checkpoint: bool
    tensorboard: bool
    plot: bool
    quiet: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DlrmJobConfig:
        """The record of parsed flags (every flag; an unknown one is a ``TypeError``)."""
        return cls(**vars(args))

    def replace_known(self, values: Mapping[str, Any]) -> DlrmJobConfig:
        """This record with the flags in ``values`` replaced; names that are no flag (of
        an older job's ``args.json``) are left out."""
        names = {f.name for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: v for k, v in values.items() if k in names})

    def as_json(self) -> dict[str, Any]:
        """``{flag: value}`` in the parser's order, as ``args.json``'s ``"args"``."""
        return dataclasses.asdict(self)
