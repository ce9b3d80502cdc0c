"""Perceptron and MLP (TorchRec's ``torchrec.modules.mlp``)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from .activation import Activation, SwishLayerNorm, identity, resolve_activation
from .initializers import torch_linear


class Perceptron(nnx.Module):
    """A linear transformation followed by an activation: ``activation(x @ W + b)``.

    Parameters live in ``_linear`` (an ``nnx.Linear`` initialised like
    ``torch.nn.Linear``), so TorchRec's ``_linear.weight`` / ``_linear.bias``
    import directly (the weight transposed).

    Args:
        in_size: input features ``I``.
        out_size: output features ``O``.
        bias: learn an additive bias.
        activation: a callable applied to the linear output (default
            ``jax.nn.relu``), or an ``nnx.Module`` (its parameters live under
            ``_activation_fn``); ``"relu"`` and ``"sigmoid"`` are accepted too.
        rngs: ``nnx.Rngs`` for initialisation.
        dtype: computation dtype (default: inferred from inputs and params).
        param_dtype: parameter dtype.

    Example:
        >>> perceptron = Perceptron(40, 16, rngs=nnx.Rngs(0))
        >>> perceptron(jnp.ones((3, 40))).shape
        (3, 16)
    """

    def __init__(
        self,
        in_size: int,
        out_size: int,
        bias: bool = True,
        activation: Activation = jax.nn.relu,
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
    ):
        self._in_size = in_size
        self._out_size = out_size
        self._linear = torch_linear(
            in_size, out_size, bias, rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )
        if isinstance(activation, str):
            activation = resolve_activation(activation)
        if not callable(activation):
            raise TypeError(f"activation must be callable, got {type(activation).__name__}")
        self._activation_fn = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[B, I] -> [B, O]``."""
        return self._activation_fn(self._linear(x))


class MLP(nnx.Module):
    """A stack of :class:`Perceptron` layers (TorchRec's ``MLP``).

    Args:
        in_size: input features.
        layer_sizes: ``out_size`` of each Perceptron.
        bias: learn additive biases.
        activation: ``"relu"``, ``"sigmoid"``, ``"swish_layernorm"`` (a
            :class:`SwishLayerNorm` per layer), a callable on arrays (default
            ``jax.nn.relu``), an ``nnx.Module`` shared by all layers, or a
            callable taking no arguments that returns a new ``nnx.Module`` per
            layer (parameters not shared), as TorchRec accepts them.
        activation_on_last: apply the activation after the last layer too.
        rngs: ``nnx.Rngs`` for initialisation.
        dtype: computation dtype.
        param_dtype: parameter dtype.

    Parameters are at ``_mlp.<i>._linear.{weight,bias}`` in TorchRec's
    ``state_dict`` naming (see :func:`jaxrec.modules.load_torchrec_state_dict`).

    Example:
        >>> mlp = MLP(40, [16, 8, 4], rngs=nnx.Rngs(0))
        >>> mlp(jnp.ones((3, 40))).shape
        (3, 4)
    """

    def __init__(
        self,
        in_size: int,
        layer_sizes: Sequence[int],
        bias: bool = True,
        activation: Activation = jax.nn.relu,
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        activation_on_last: bool = True,
    ):
        layer_sizes = [int(s) for s in layer_sizes]
        if not layer_sizes:
            raise ValueError("MLP needs at least one layer size, got layer_sizes=[]")
        layers = []
        for i, out_size in enumerate(layer_sizes):
            last = i == len(layer_sizes) - 1
            if last and not activation_on_last:
                act = identity
            elif activation == "swish_layernorm":
                act = SwishLayerNorm(out_size, dtype=dtype, param_dtype=param_dtype)
            else:
                act = resolve_activation(activation)
            layers.append(
                Perceptron(
                    layer_sizes[i - 1] if i > 0 else in_size,
                    out_size,
                    bias=bias,
                    activation=act,
                    rngs=rngs,
                    dtype=dtype,
                    param_dtype=param_dtype,
                )
            )
        self._mlp = nnx.Sequential(*layers)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[B, in_size] -> [B, layer_sizes[-1]]``."""
        return self._mlp(x)
