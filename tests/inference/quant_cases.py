"""Small tables, batches and numpy oracles shared by the quantization tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxrec as jr
from jaxrec.xla.quantize import quantize_rows, row_error_bound

DTYPES = ("int8", "int4", "fp16", "bf16", "fp32")
KEYS = ("f1", "f2", "f3")
B = 5
CAP = 24


def tables():
    """Dims 10 (not a power of two) and 16; t2 (MEAN) read by two features."""
    return [
        jr.EmbeddingBagConfig(name="t1", embedding_dim=10, num_embeddings=30, feature_names=["f1"]),
        jr.EmbeddingBagConfig(
            name="t2",
            embedding_dim=16,
            num_embeddings=40,
            feature_names=["f2", "f3"],
            pooling=jr.PoolingType.MEAN,
        ),
    ]


def bags(seed=0):
    """``{key: [B lists of ids]}`` with an empty bag, a duplicate id and one long bag."""
    rng = np.random.default_rng(seed)
    rows = {"f1": 30, "f2": 40, "f3": 40}
    out = {}
    for k in KEYS:
        out[k] = [rng.integers(0, rows[k], int(rng.integers(1, 5))).tolist() for _ in range(B)]
        out[k][0] = []
        out[k][2] = out[k][2] + out[k][2][:1]
    out["f1"][3] = [7] * 6
    return out


def weights_for(b, seed=1):
    rng = np.random.default_rng(seed)
    return {k: [rng.uniform(0.5, 2.0, len(x)).tolist() for x in b[k]] for k in KEYS}


def kjt(b, w=None):
    lengths = [len(x) for k in KEYS for x in b[k]]
    values = [i for k in KEYS for x in b[k] for i in x]
    ws = None if w is None else np.asarray([v for k in KEYS for x in w[k] for v in x], np.float32)
    return jr.KeyedJaggedTensor.from_lengths_sync(
        list(KEYS), values, lengths, weights=ws, capacities={k: CAP for k in KEYS}
    )


def pooled_bound(table: np.ndarray, dtype: str, b, w=None, mean=False) -> np.ndarray:
    """``[B, D]`` bound on |quantized pooled - float pooled| for one feature's bags:
    sum over the bag of |weight| x the row's quantization error bound (/ L for MEAN),
    plus float32 accumulation slack."""
    q = quantize_rows(table, dtype)
    per_row = np.asarray(row_error_bound(table, q, dtype))
    out = np.zeros((len(b), table.shape[1]), np.float32)
    for i, ids in enumerate(b):
        ws = np.ones(len(ids)) if w is None else np.abs(np.asarray(w[i]))
        s = float(np.sum(ws * per_row[ids])) if ids else 0.0
        s += 1e-6 * (1 + float(np.sum(ws * np.abs(table[ids]).max(axis=1)))) if ids else 0.0
        out[i] = s / max(len(ids), 1) if mean else s
    return out


def ebc_bounds(ebc, dtype, b, w=None) -> np.ndarray:
    """``[B, sum(D)]`` bounds in the EBC's output order."""
    sd = {k.split(".")[1]: np.asarray(v, np.float32) for k, v in ebc.state_dict().items()}
    parts = []
    for t in ebc.table_configs:
        for f in t.feature_names:
            mean = t.pooling is jr.PoolingType.MEAN
            parts.append(pooled_bound(sd[t.name], dtype, b[f], None if w is None else w[f], mean))
    return np.concatenate(parts, axis=1)


@nnx.jit
def _call(module, *args):
    return module(*args)


def jit_call(module, *args):
    """``module(*args)`` compiled; one cache for every test, so equal modules compile once."""
    return _call(module, *args)


def assert_within(got, want, bound):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"max excess {np.max(err - bound)} at {np.argmax(err - bound)}"


def random_table(seed, rows, dim, scale=1.0):
    rng = np.random.default_rng(seed)
    t = rng.normal(size=(rows, dim)).astype(np.float32) * scale
    t[1] = 0.25  # a constant row (scale 1 in FBGEMM)
    t[2, :] = np.linspace(-3, 5, dim)  # exact min and max
    return jnp.asarray(t)
