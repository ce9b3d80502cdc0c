"""Train steps match TorchRec's fused optimizers (DistributedModelParallel, CPU, world size 1).

TorchRec applies ``fused_params`` inside the backward of a sharded
``EmbeddingBagCollection`` (FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``
on CPU). The same initial tables, batches and loss go through jaxrec's sparse
train step and through DMP; the tables must agree after every step. Only the
optimizers FBGEMM runs on CPU are covered (EXACT_SGD, EXACT_ADAGRAD,
EXACT_ROWWISE_ADAGRAD) with weight decay off, plus row-wise Adagrad's L2 and
DECOUPLE weight decay compared on the shared table only (FBGEMM's CPU fast path
drops weight decay for fp32 tables read by a single feature; DESIGN.md section 4).
"""

import contextlib
import socket

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from numpy_reference import packed, random_bags

import jaxrec as jr
from jaxrec.embedding.optimizer import CombinedOptimizer
from jaxrec.optim import adagrad, rowwise_adagrad, sgd
from jaxrec.train.step import init_train_state, make_train_step, merge_model

torch = pytest.importorskip("torch")
torchrec = pytest.importorskip("torchrec")

import torch.distributed as dist  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from fbgemm_gpu.tbe.config import WeightDecayMode as FbgemmWeightDecayMode  # noqa: E402
from torchrec.distributed import DistributedModelParallel  # noqa: E402
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.sharding_plan import (  # noqa: E402
    construct_module_sharding_plan,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan  # noqa: E402

B, MAX_LEN, STEPS = 8, 6, 3
LR, EPS = 0.1, 0.01  # eps large enough that its place (outside the sqrt) shows at rtol 1e-5

TABLES = [  # t1 is shared by two features; SUM and MEAN pooling; two dims
    jr.EmbeddingBagConfig(
        name="t1", embedding_dim=8, num_embeddings=50, feature_names=["f1", "f2"]
    ),
    jr.EmbeddingBagConfig(
        name="t2",
        embedding_dim=8,
        num_embeddings=40,
        feature_names=["f3"],
        pooling=jr.PoolingType.MEAN,
    ),
    jr.EmbeddingBagConfig(name="t3", embedding_dim=4, num_embeddings=30, feature_names=["f4"]),
]
KEYS = [f for t in TABLES for f in t.feature_names]
ROWS = {f: t.num_embeddings for t in TABLES for f in t.feature_names}
WIDTH = sum(t.embedding_dim * len(t.feature_names) for t in TABLES)

CASES = {  # id -> (jaxrec sparse optimizer, TorchRec fused_params, tables compared)
    "EXACT_SGD": (
        sgd(LR),
        {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR},
        ("t1", "t2", "t3"),
    ),
    "EXACT_ADAGRAD": (
        adagrad(LR, eps=EPS),
        {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": LR, "eps": EPS},
        ("t1", "t2", "t3"),
    ),
    "EXACT_ROWWISE_ADAGRAD": (
        rowwise_adagrad(LR, eps=EPS),
        {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": EPS},
        ("t1", "t2", "t3"),
    ),
    # With weight decay only the shared table t1 is comparable: FBGEMM's CPU fast path
    # (fp32 tables read by one feature) passes weight_decay=0 to fbgemm's row-wise
    # Adagrad kernel, so t2 and t3 train without decay there (DESIGN.md section 4).
    **{
        f"EXACT_ROWWISE_ADAGRAD-{mode}": (
            rowwise_adagrad(LR, eps=EPS, weight_decay=0.05, weight_decay_mode=mode),
            {
                "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                "learning_rate": LR,
                "eps": EPS,
                "weight_decay": 0.05,
                "weight_decay_mode": getattr(FbgemmWeightDecayMode, mode),
            },
            ("t1",),
        )
        for mode in ("L2", "DECOUPLE")
    },
}


@contextlib.contextmanager
def gloo_world_of_one():
    """A single-rank gloo process group on a free local port, destroyed on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def torchrec_dmp(fused_params):
    """A fused, table-wise sharded TorchRec EBC on CPU (the planner would pick dense DP)."""
    configs = [
        torchrec.EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.embedding_dim,
            num_embeddings=t.num_embeddings,
            feature_names=list(t.feature_names),
            pooling=getattr(torchrec.PoolingType, t.pooling.value),
        )
        for t in TABLES
    ]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params)
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={t.name: table_wise(rank=0, compute_kernel="fused") for t in TABLES},
        local_size=1,
        world_size=1,
        device_type="cpu",
        sharder=sharder,
    )
    return DistributedModelParallel(
        ebc, device=torch.device("cpu"), sharders=[sharder], plan=ShardingPlan({"": plan})
    )


def torch_tables(dmp):
    """``{"embedding_bags.<t>.weight": ndarray}`` from DMP's sharded state dict (one shard).

    Only ``local_shards()`` is touched: most other ShardedTensor attributes (``.shape``)
    go through its ``__torch_function__``, which raises a FutureWarning (deprecated in
    favour of DTensor).
    """
    out = {}
    for k, v in dmp.state_dict().items():
        (shard,) = v.local_shards()
        out[k.removeprefix("module.")] = shard.tensor.detach().numpy().copy()
    return out


def batches(seed):
    """Random bags per feature: duplicate ids within and across bags, some empty bags."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        bags = []
        for k in KEYS:
            fb = random_bags(rng, B, MAX_LEN - 1, ROWS[k])
            fb[0] = []  # an empty bag in every feature
            fb[1] = fb[1] or [int(rng.integers(ROWS[k]))]
            fb[1].append(fb[1][0])  # a duplicate id within a bag
            bags.append(fb)
        out.append(packed(bags))
    return out


class EbcOnly(nnx.Module):
    def __init__(self):
        self.ebc = jr.EmbeddingBagCollection(TABLES, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("case", list(CASES))
def test_train_steps_match_torchrec_fused_optimizer(case):
    sparse_opt, fused_params, compared = CASES[case]
    m = np.random.default_rng(1).normal(size=(B, WIDTH)).astype(np.float32)
    torch.manual_seed(0)  # DMP initialises the tables
    with gloo_world_of_one():
        dmp = torchrec_dmp(fused_params)
        initial = torch_tables(dmp)
        model = EbcOnly()
        model.ebc.load_state_dict(initial)

        opt = CombinedOptimizer(optax.sgd(0.0), sparse_opt)
        graphdef, state = init_train_state(model, opt)
        mj = jnp.asarray(m)
        step = make_train_step(graphdef, opt, lambda mdl, kjt: jnp.sum(mdl.ebc(kjt).values() * mj))
        mt = torch.from_numpy(m)

        for i, (values, lengths) in enumerate(batches(seed=2)):
            kjt = jr.KeyedJaggedTensor.from_lengths_sync(
                KEYS, values, lengths, capacities=B * MAX_LEN
            )
            state, loss, _ = step(state, kjt)
            tkjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
                keys=KEYS,
                values=torch.as_tensor(values, dtype=torch.int64),
                lengths=torch.as_tensor(lengths, dtype=torch.int32),
            )
            # The sharded EBC orders its output keys by sharding group (here SUM tables,
            # then MEAN: f1, f2, f4, f3), unlike the unsharded one (and jaxrec): regroup.
            pooled = dmp(tkjt).to_dict()
            assert sorted(pooled) == sorted(KEYS)
            tloss = torch.sum(torch.cat([pooled[k] for k in KEYS], dim=1) * mt)
            tloss.backward()  # applies the fused optimizer to the touched rows

            if i == 0 or len(compared) == len(TABLES):  # same tables in, same loss out
                np.testing.assert_allclose(float(loss), tloss.item(), rtol=1e-5, atol=1e-5)
            ours = {
                k: np.asarray(v) for k, v in merge_model(graphdef, state).ebc.state_dict().items()
            }
            theirs = torch_tables(dmp)
            assert list(ours) == list(theirs)
            for k in theirs:
                assert not np.array_equal(theirs[k], initial[k]), f"{k} did not train"
                if k.split(".")[1] not in compared:
                    continue
                np.testing.assert_allclose(
                    ours[k], theirs[k], rtol=1e-5, atol=1e-6, err_msg=f"step {i}: {k}"
                )
