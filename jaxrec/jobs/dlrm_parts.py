"""The pieces of ``jaxrec-train-dlrm``: data, model, sharding, steps, evaluation."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from .. import datasets, metrics
from .. import distributed as dist
from ..configs import EmbeddingBagConfig
from ..datasets import Batch, Part, TableDataset
from ..distributed import planner
from ..embedding import CombinedOptimizer
from ..models import DLRM, DLRM_DCN
from ..models.dlrm import bag_collection_of
from ..modules import EmbeddingBagCollection
from ..optim import rowwise_adagrad
from ..sparse import KeyedJaggedTensor
from ..train import (
    InFlight,
    TrainState,
    TrainStep,
    init_train_state,
    make_accumulating_train_step,
    make_eval_step,
    make_semi_sync_train_step,
    make_sparse_dist_train_step,
    make_train_step,
)
from .dlrm_config import DlrmJobConfig
from .dlrm_dynamic import dynamic_collection
from .shards import rank_batches

if TYPE_CHECKING:
    from ..cache import RowCache

EBC_PATH = "sparse_arch.embedding_bag_collection"


# ----- data -----
# Where the data comes from, for the error when it is missing.
CRITEO_SOURCE = (
    "Criteo's click logs are not downloaded for you: get Kaggle's Display Advertising "
    "Challenge train.txt or the Criteo 1TB Click Logs (day_0 .. day_23) and pass their "
    "folder as --data-dir (python -m jaxrec.datasets.criteo preprocess converts TSV to npy)"
)


def load_data(config: DlrmJobConfig) -> tuple[TableDataset, TableDataset]:
    """``(train, eval)`` datasets with ``keys``, ``num_embeddings_per_feature``, ``num_dense``.

    Missing or unreadable data ends the job with a one-line ``SystemExit`` that
    says what was wrong and where the data comes from.
    """
    try:
        return _load_data(config)
    except (OSError, ValueError) as e:  # FileNotFoundError, CriteoParseError, a failed fetch
        source = CRITEO_SOURCE if config.dataset == "criteo" else ""  # MovieLens's errors say it
        text = " / ".join(line.strip() for line in str(e).splitlines() if line.strip())
        missing = isinstance(e, FileNotFoundError) and source
        hint = f"; {source}" if missing else ""
        raise SystemExit(f"--dataset {config.dataset}: {text}{hint}") from None


def _load_data(config: DlrmJobConfig) -> tuple[TableDataset, TableDataset]:
    sizes = _multi_hot_sizes(config.multi_hot)
    # Several processes: each opens the files for its own part, so it holds no rows
    # beyond its devices' batches (read per batch); batches() is always told its part.
    count = jax.process_count()
    part = Part(jax.process_index(), count) if count > 1 else None
    if config.dataset == "synthetic":
        return datasets.synthetic_criteo_split(
            num_train=config.num_train,
            num_eval=config.num_eval,
            seed=config.seed,
            multi_hot_sizes=sizes,
        )
    if config.dataset == "movielens" and sizes is not None:
        raise SystemExit("--multi-hot applies to criteo and synthetic data, not movielens")
    if config.data_dir is None:
        if config.dataset == "movielens":
            return datasets.movielens_split(
                datasets.fetch_movielens_100k(), seed=config.seed, part=part
            )
        raise SystemExit(
            f"--dataset criteo needs --data-dir (TSV day files or npy files); {CRITEO_SOURCE}"
        )
    if config.dataset == "criteo":
        n = config.num_embeddings
        multi = None if sizes is None else datasets.MultiHot(sizes, [n] * len(sizes), method="hash")
        on_error = "skip" if config.skip_malformed else "raise"
        return datasets.criteo_split(
            config.data_dir, num_embeddings=n, multi_hot=multi, on_error=on_error, part=part
        )
    return datasets.movielens_split(config.data_dir, seed=config.seed, part=part)


# MLPerf DLRM-DCNv2's multi-hot bag size per Criteo feature.
MLPERF_MULTI_HOT = (
    3,
    2,
    1,
    2,
    6,
    1,
    1,
    1,
    1,
    7,
    3,
    8,
    1,
    6,
    9,
    5,
    1,
    1,
    1,
    12,
    100,
    27,
    10,
    3,
    1,
    1,
)


def _multi_hot_sizes(flag: str | None) -> list[int] | None:
    if flag is None:
        return None
    if flag == "mlperf":
        return list(MLPERF_MULTI_HOT)
    if not flag.isdigit() or int(flag) < 1:
        raise SystemExit(f"--multi-hot must be a positive integer or 'mlperf', got {flag!r}")
    return [int(flag)] * len(MLPERF_MULTI_HOT)


# ----- model -----
class DataSizes(Protocol):
    """What the model's shape takes from the data: a ``TableDataset``, or the sizes a
    run saved (``from_run.RunData``)."""

    @property
    def keys(self) -> Sequence[str]: ...

    @property
    def num_embeddings_per_feature(self) -> Sequence[int]: ...

    @property
    def num_dense(self) -> int: ...


def table_configs(config: DlrmJobConfig, data: DataSizes) -> list[EmbeddingBagConfig]:
    """One table ``t_<feature>`` per feature (the logical tables, whatever is cached)."""
    return [
        EmbeddingBagConfig(
            name=f"t_{key}",
            embedding_dim=config.embedding_dim,
            num_embeddings=int(n),
            feature_names=[key],
        )
        for key, n in zip(data.keys, data.num_embeddings_per_feature, strict=True)
    ]


def build_model(
    config: DlrmJobConfig, data: DataSizes, tables: list[EmbeddingBagConfig] | None = None
) -> DLRM:
    """DLRM (or DLRM-DCN) over ``tables`` (default :func:`table_configs`; a cached
    model passes its slot tables)."""
    tables = tables or table_configs(config, data)
    if config.dynamic_tables:  # rows keyed by the raw id, behind a hash index per table
        ebc = dynamic_collection(config, tables, config.seed)
    else:
        ebc = EmbeddingBagCollection(tables, rngs=nnx.Rngs(config.seed))
    dense = [int(x) for x in config.dense_arch.split(",")]
    over = [int(x) for x in config.over_arch.split(",")]
    if dense[-1] != config.embedding_dim:
        raise SystemExit(
            f"--dense-arch must end in the embedding dim {config.embedding_dim}, got {dense}"
        )
    num_dense = max(int(data.num_dense), 1)  # DLRM needs a dense input; a constant if none
    rngs = nnx.Rngs(config.seed + 1)
    if config.model == "dcn":
        return DLRM_DCN(
            embedding_bag_collection=ebc,
            dense_in_features=num_dense,
            dense_arch_layer_sizes=dense,
            over_arch_layer_sizes=over,
            rngs=rngs,
            dcn_num_layers=config.dcn_layers,
            dcn_low_rank_dim=config.dcn_rank,
        )
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=num_dense,
        dense_arch_layer_sizes=dense,
        over_arch_layer_sizes=over,
        rngs=rngs,
    )


def as_dlrm(model: nnx.Module) -> DLRM:
    """``model`` as the job builds it: a ``DLRM`` (or ``DLRM_DCN``), sharded or not."""
    if not isinstance(model, DLRM):
        raise TypeError(f"the DLRM job's model is a DLRM or DLRM_DCN, got {type(model).__name__}")
    return model


def collection_of(model: nnx.Module) -> EmbeddingBagCollection:
    """The model's embedding bag collection (the one behind its dynamic tables' indexes)."""
    return bag_collection_of(as_dlrm(model).sparse_arch.embedding_bag_collection)


def sharded_collection_of(model: nnx.Module) -> dist.ShardedEmbeddingBagCollection:
    """:func:`collection_of` a model sharded by ``DistributedModelParallel``."""
    ebc = collection_of(model)
    if not isinstance(ebc, dist.ShardedEmbeddingBagCollection):
        raise TypeError(f"the model's tables are not sharded: a {type(ebc).__name__}")
    return ebc


def make_mesh(config: DlrmJobConfig) -> jax.sharding.Mesh:
    """A mesh ``("x",)`` of ``--devices`` devices, every process's."""
    n = config.devices
    try:
        devices = dist.mesh_devices(n)  # n / process_count from each process
    except ValueError as e:
        raise SystemExit(f"--devices {n}: {e}") from None
    return jax.make_mesh((n,), ("x",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))


def logical_plan(
    config: DlrmJobConfig,
    model: nnx.Module,
    mesh: jax.sharding.Mesh,
    constraints: Mapping[str, planner.ParameterConstraints] | None = None,
) -> dist.EmbeddingModuleShardingPlan:
    """The plan of the collection's logical tables over ``mesh``: ``--sharding``'s, or
    the planner's for ``--batch-size`` samples a device, ``--hbm-gib`` of device memory
    (default: what the devices report) and ``constraints`` (``{table:
    ParameterConstraints}``). ``model`` may be abstract (``nnx.eval_shape``)."""
    n = mesh.size
    ebc = collection_of(model)
    if config.dynamic_tables:  # whole hash buckets per device: the row-wise blocks
        names = [t.name for t in ebc.table_configs]
        return dist.construct_module_sharding_plan(
            ebc, {t: dist.row_wise() for t in names}, world_size=n
        )
    if config.sharding != "planner":
        names = [t.name for t in ebc.table_configs]
        gens = {
            "table_wise": lambda i: dist.table_wise(i % n),
            "row_wise": lambda i: dist.row_wise(),
            "column_wise": lambda i: dist.column_wise(list(range(min(n, 2)))),
            "data_parallel": lambda i: dist.data_parallel(),
        }[config.sharding]
        return dist.construct_module_sharding_plan(
            ebc, {t: gens(i) for i, t in enumerate(names)}, world_size=n
        )
    hbm = config.hbm_gib
    extra = {} if hbm is None else {"hbm_cap": int(hbm * 2**30)}
    topology = planner.Topology.from_devices(
        list(mesh.devices.flat), batch_size=config.batch_size, **extra
    )
    try:
        plan = planner.plan_for_model(
            model,
            mesh,
            optimizer=build_optimizer(config),
            topology=topology,
            constraints=constraints,
            scale_up_caches=config.cache_scale_up,
        )
    except planner.PlannerError as e:
        raise SystemExit(f"--sharding planner: {e}") from None
    return plan.plan[EBC_PATH]


def shard(
    config: DlrmJobConfig,
    model: nnx.Module | Callable[[], nnx.Module],
    mesh: jax.sharding.Mesh | None = None,
    plan: dist.EmbeddingModuleShardingPlan | None = None,
) -> tuple[jax.sharding.Mesh | None, nnx.Module, str]:
    """``(mesh or None, model, plan description)``: the model over ``--devices``
    devices with ``plan`` (default :func:`logical_plan`); one device: unsharded.

    ``model``: the model, or its constructor (a function of no arguments): sharded, each
    device then draws only its own shards (no table is ever whole on one device)."""
    if config.devices == 1:
        return None, (model if isinstance(model, nnx.Module) else model()), "unsharded"
    mesh = make_mesh(config) if mesh is None else mesh
    if plan is None:
        abstract = model if isinstance(model, nnx.Module) else nnx.eval_shape(model)
        plan = logical_plan(config, abstract, mesh)
    q = config.qcomms
    qcomms = dist.QCommsConfig(forward_precision=q, backward_precision=q)
    model = dist.DistributedModelParallel(
        model, dist.ShardingPlan({EBC_PATH: plan}), mesh, qcomms=qcomms
    )
    sharded = sharded_collection_of(model)
    kinds = sorted(
        {str(getattr(p.sharding_type, "value", p.sharding_type)) for p in sharded.plan.values()}
    )
    return mesh, model, ",".join(kinds)


def plan_rows(model: nnx.Module) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(table, sharding type, ranks)`` of a sharded model's embedding tables."""
    plan = sharded_collection_of(model).plan
    return [
        (name, str(getattr(p.sharding_type, "value", p.sharding_type)), tuple(p.ranks))
        for name, p in plan.items()
    ]


def fit_capacities(
    model: nnx.Module,
    data: TableDataset,
    config: DlrmJobConfig,
    batches: int = 8,
    view: Callable[[KeyedJaggedTensor], KeyedJaggedTensor] | None = None,
) -> dict[str, int]:
    """Sizes the sharded collection's id exchange from the loads of the first training
    batches (measured statistics: these ids are skewed, so a row-wise shard holding hot
    rows gets more than its share, which would cost extra exchange rounds every step).
    ``view``: host KJT -> the KJT the collection sees (cached tables' ids as slots).
    Returns ``{width group: capacity}``."""
    sharded = sharded_collection_of(model)
    # The one-process stream on every process: each must compile the same program.
    sample = data.batches(
        config.batch_size, shuffle=True, seed=config.seed, epoch=0, part=Part(0, 1)
    )
    kjts = [b.sparse_features for b in itertools.islice(sample, batches * config.devices)]
    kjts = kjts if view is None else [view(k) for k in kjts]
    capacity = sharded.measure_capacities(kjts)
    sharded.capacity = capacity
    return capacity


# ----- steps -----
def build_optimizer(config: DlrmJobConfig) -> CombinedOptimizer:
    return CombinedOptimizer(optax.adam(config.dense_lr), rowwise_adagrad(config.sparse_lr))


def _dense(batch) -> jax.Array:
    dense = batch.dense_features
    return jnp.ones((dense.shape[0], 1), jnp.float32) if dense.shape[1] == 0 else dense


def bce(model, batch):
    logits = model(_dense(batch), batch.sparse_features)[:, 0]
    return optax.sigmoid_binary_cross_entropy(logits, batch.labels).mean()


# the eval step: (state, device batch) -> predictions
EvalStep = Callable[[TrainState, Batch], jax.Array]


class Steps(NamedTuple):
    """The model split for training, and its jitted steps."""

    graphdef: nnx.GraphDef
    state: TrainState
    step: TrainStep
    eval_step: EvalStep


def make_steps(model: nnx.Module, optimizer: CombinedOptimizer, config: DlrmJobConfig) -> Steps:
    eval_graphdef = None
    if config.dynamic_tables:  # eval looks ids up, never admits: a deterministic twin
        model.eval()
        eval_graphdef = nnx.graphdef(model)
        model.train()
    graphdef, state = init_train_state(model, optimizer)
    # A batch with a NaN/inf (label, dense feature) is skipped and counted, not trained on:
    # one such batch would otherwise leave NaN in the MLPs and in the touched rows for good.
    make = {
        "sync": make_train_step,
        "sparse-dist": make_sparse_dist_train_step,
        "semi-sync": make_semi_sync_train_step,
    }[config.pipeline]
    k = config.grad_accumulation
    if k > 1:  # one update per k micro-batches (the job refuses the other pipelines)
        step = make_accumulating_train_step(
            graphdef, optimizer, bce, micro_batches=k, skip_nonfinite=True
        )
    else:
        step = make(graphdef, optimizer, bce, skip_nonfinite=True)
    eval_step = make_eval_step(
        eval_graphdef or graphdef,
        lambda m, b: jax.nn.sigmoid(m(_dense(b), b.sparse_features)[:, 0]),
    )
    return Steps(graphdef, state, step, eval_step)


# ----- evaluation -----
def evaluate(
    eval_step: EvalStep,
    state: TrainState,
    data: TableDataset,
    config: DlrmJobConfig,
    mesh: jax.sharding.Mesh | None,
) -> dict[str, float]:
    """AUC, NE, log loss, calibration and CTR over every eval sample (exact AUC);
    :func:`evaluate_cached` for a model with cached tables."""
    return _evaluate(eval_step, state, data, config, mesh, None)[0]


def evaluate_cached(
    eval_step: EvalStep,
    state: TrainState,
    data: TableDataset,
    config: DlrmJobConfig,
    mesh: jax.sharding.Mesh | None,
    cache: RowCache,
) -> tuple[dict[str, float], TrainState]:
    """``(metrics, state)``: :func:`evaluate` of a model whose cached tables are in
    ``cache`` (a ``RowCache``): each batch's rows are loaded before its step (which takes
    ``state``: go on with the state returned). Call it with no batch prefetched."""
    return _evaluate(eval_step, state, data, config, mesh, cache)


def _evaluate(
    eval_step: EvalStep,
    state: TrainState,
    data: TableDataset,
    config: DlrmJobConfig,
    mesh: jax.sharding.Mesh | None,
    cache: RowCache | None,
) -> tuple[dict[str, float], TrainState]:
    """The metrics of :func:`evaluate`, and the state (after the cache's loads).

    The rows after the last full global batch are spread over the devices and
    each device's batch padded with empty samples of weight 0, so no sample is
    dropped and every step has the training shapes (no recompile). Each process
    reads its own devices' batches; the metric state is global (replicated over
    the mesh), so every process computes the same metrics.
    """
    world, size = config.devices, config.batch_size
    global_size = size * world
    capacity = -(-len(data) // global_size) * global_size
    collection = metrics.MetricCollection(
        [
            metrics.AUCMetric(capacity=capacity),
            metrics.NEMetric(),
            metrics.CalibrationMetric(),
            metrics.CTRMetric(),
        ]
    )
    mstate = collection.init()
    update = jax.jit(collection.update)
    if mesh is not None:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        mstate = jax.device_put(mstate, replicated)
        update = jax.jit(collection.update, out_shardings=replicated)
    caps = data.capacities(size)
    ranks = dist.process_ranks(mesh) if mesh is not None else [0]
    groups = rank_batches(data, size, ranks, world, shuffle=False, drop_last=False, capacities=caps)
    # A rank past the last rows gets an empty batch (a first row's keys and dtypes).
    empty = _pad(next(data.batches(1, shuffle=False, part=Part(0, 1))), size, caps, 0)
    window = InFlight()  # never far ahead of the devices: see jaxrec.train.in_flight
    for group in groups:
        rows = [0 if b is None else int(b.labels.shape[0]) for b in group]
        local = [
            empty if b is None else b if n == size else _pad(b, size, caps)
            for b, n in zip(group, rows, strict=True)
        ]
        items = [
            (b, (np.arange(size) < n).astype(np.float32)) for b, n in zip(local, rows, strict=True)
        ]
        if cache is not None:  # the cached tables' rows in their slots, ids as slots
            state, items = cache.load_batch(state, items)
        batch, weights = (
            dist.shard_batch(items, mesh) if mesh is not None else jax.device_put(items[0])
        )
        mstate = update(mstate, eval_step(state, batch), batch.labels, weights)
        window.push(mstate)
    collection.check(mstate)
    out = collection.compute(mstate)
    return {k.split("-", 1)[1]: float(np.asarray(v)) for k, v in out.items()}, state


def _pad(batch, size: int, caps, keep: int | None = None):
    """The first ``keep`` (default: all) rows of ``batch``, grown to ``size`` rows
    by empty samples (no ids, zero dense features, label 0)."""
    n = int(batch.labels.shape[0])
    keep = n if keep is None else keep
    kjt = batch.sparse_features
    keys = kjt.keys()
    lengths = np.asarray(kjt.lengths()).reshape(len(keys), n)[:, :keep]
    values = [np.asarray(kjt[k].values())[: lengths[i].sum()] for i, k in enumerate(keys)]
    grown = np.zeros((len(keys), size), lengths.dtype)
    grown[:, :keep] = lengths
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys,
        np.concatenate(values),
        grown.reshape(-1),
        stride=size,
        capacities=list(caps),
        on_host=True,
    )
    dense = np.zeros((size, *batch.dense_features.shape[1:]), np.float32)
    dense[:keep] = np.asarray(batch.dense_features)[:keep]
    labels = np.zeros(size, np.float32)
    labels[:keep] = np.asarray(batch.labels)[:keep]
    return type(batch)(dense, sparse, labels)
