"""DeepFM and the factorization machine (TorchRec's ``torchrec.modules.deepfm``).

Both take a list of embeddings ``[B, num_embeddings_i, embedding_dim_i]`` (or
``[B, D_i]``), flatten each to ``[B, -1]`` and concatenate them: embeddings
with different dims and counts mix freely as long as the batch size agrees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def flatten_embeddings(embeddings: Sequence[jax.Array]) -> jax.Array:
    """``[B, sum_i prod(shape_i[1:])]``: each input flattened after the batch axis."""
    if not embeddings:
        raise ValueError("embeddings must be a non-empty list of [B, ...] arrays")
    batch = {e.shape[0] for e in embeddings}
    if len(batch) != 1:
        raise ValueError(
            f"all embeddings need the same batch size; got shapes {[e.shape for e in embeddings]}"
        )
    return jnp.concatenate([e.reshape(e.shape[0], -1) for e in embeddings], axis=1)


class DeepFM(nnx.Module):
    """The deep component of DeepFM: ``dense_module(concat(flatten(embeddings)))``.

    Args:
        dense_module: any module or callable (an :class:`~jaxrec.modules.MLP`, an
            ``nnx.Sequential`` ...) whose input width is the total element count
            of one sample's embeddings (``[randn(B, 2, 3), randn(B, 4, 5)]``:
            ``2*3 + 4*5``). Its parameters live under ``dense_module``.

    Example:
        >>> deepfm = DeepFM(dense_module=nnx.Linear(192, 30, rngs=nnx.Rngs(0)))
        >>> deepfm([jnp.ones((3, 2, 64)), jnp.ones((3, 2, 32))]).shape
        (3, 30)
    """

    def __init__(self, dense_module: nnx.Module | Callable[[jax.Array], jax.Array]):
        if not callable(dense_module):
            raise TypeError(f"dense_module must be callable, got {type(dense_module).__name__}")
        self.dense_module = dense_module

    def __call__(self, embeddings: Sequence[jax.Array]) -> jax.Array:
        return self.dense_module(flatten_embeddings(embeddings))


class FactorizationMachine(nnx.Module):
    r"""The FM component of DeepFM: second-order interactions, ``[B, 1]``.

    As TorchRec computes it, over the flattened concatenated input ``x``
    (``[B, n]``, every element of every embedding):
    ``0.5 * ((sum_i x_i)^2 - sum_i x_i^2)``. No parameters.

    Example:
        >>> fm = FactorizationMachine()
        >>> fm([jnp.ones((3, 2, 64)), jnp.ones((3, 2, 32))]).shape
        (3, 1)
    """

    def __call__(self, embeddings: Sequence[jax.Array]) -> jax.Array:
        x = flatten_embeddings(embeddings)
        sum_of_input = jnp.sum(x, axis=1, keepdims=True)
        sum_of_square = jnp.sum(x * x, axis=1, keepdims=True)
        return 0.5 * (sum_of_input * sum_of_input - sum_of_square)
