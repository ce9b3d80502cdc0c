"""Shared pieces of the module and model parity tests against TorchRec (CPU).

Parity tests call :func:`needs_torchrec` first, so they skip where torch or
torchrec is missing while the rest of each file still runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxrec as jr
import jaxrec.modules as jm

RTOL, ATOL = 1e-5, 1e-5


def needs_torchrec():
    """``(torch, torchrec)``, or skip the calling test."""
    return pytest.importorskip("torch"), pytest.importorskip("torchrec")


def randomize(module, seed: int = 0, scale: float = 0.5):
    """Overwrites every torch parameter with N(0, scale^2): zero-initialised biases
    and all-ones position weights would hide mapping mistakes."""
    torch, _ = needs_torchrec()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return module


def jit_call(module, *args, **kwargs):
    """``module(*args, **kwargs)`` compiled once: much faster than op-by-op eager
    dispatch for the many small ops of a lookup."""
    return nnx.jit(lambda m, *a, **kw: m(*a, **kw))(module, *args, **kwargs)


def run_torch(module, *args, **kwargs) -> np.ndarray:
    torch, _ = needs_torchrec()
    with torch.no_grad():
        out = module(*args, **kwargs)
    return out.numpy() if hasattr(out, "numpy") else out


def to_torch(x):
    torch, _ = needs_torchrec()
    return torch.from_numpy(np.asarray(x))


def torch_kjt(keys, values, lengths, weights=None):
    torch, torchrec = needs_torchrec()
    return torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys),
        values=torch.as_tensor(np.asarray(values), dtype=torch.int64),
        lengths=torch.as_tensor(np.asarray(lengths), dtype=torch.int32),
        weights=None if weights is None else torch.as_tensor(np.asarray(weights)),
    )


def torch_tables(tables):
    """TorchRec ``EmbeddingBagConfig`` s equal to jaxrec ones."""
    _, torchrec = needs_torchrec()
    return [
        torchrec.EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.embedding_dim,
            num_embeddings=t.num_embeddings,
            feature_names=list(t.feature_names),
            pooling=getattr(torchrec.PoolingType, t.pooling.value),
        )
        for t in tables
    ]


def random_kjt_arrays(rng, keys, num_embeddings, batch, max_len=4, empty_bag=True):
    """TorchRec-layout ``(values, lengths)`` with empty bags and repeated ids."""
    lengths = rng.integers(0, max_len + 1, size=len(keys) * batch)
    if empty_bag:
        lengths[0] = 0
    values = np.concatenate(
        [
            rng.integers(0, num_embeddings[k], size=int(lengths[i * batch : (i + 1) * batch].sum()))
            for i, k in enumerate(keys)
        ]
    )
    return values.astype(np.int64), lengths.astype(np.int64)


def jax_kjt(keys, values, lengths, weights=None, capacity=None):
    caps = None if capacity is None else {k: capacity for k in keys}
    return jr.KeyedJaggedTensor.from_lengths_sync(
        keys, values, lengths, weights=weights, capacities=caps
    )


def assert_close(ours, theirs, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=rtol, atol=atol)


def assert_finite_tree(tree):
    for leaf in jax.tree.leaves(tree):
        assert bool(jnp.all(jnp.isfinite(leaf))), leaf


def numpy_weights(build, seed=0, scale=0.3):
    """The module ``build()`` makes, with N(0, scale^2) weights from numpy loaded through
    the TorchRec importer: no JAX random-init compilations (seconds per model on CPU)."""
    model = nnx.eval_shape(build)
    rng = np.random.default_rng(seed)
    shapes = jm.torchrec_keys(model)
    sd = {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    jm.load_torchrec_state_dict(model, sd)
    return model
