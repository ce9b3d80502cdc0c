"""Activations: TorchRec's ``SwishLayerNorm`` and how modules accept an activation."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

Activation = str | nnx.Module | Callable[..., jax.Array]

_BY_NAME: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "sigmoid": jax.nn.sigmoid,
}


class LayerNorm(nnx.Module):
    """``torch.nn.LayerNorm(normalized_shape)``: biased variance, ``eps=1e-5``, affine.

    Normalises over the trailing ``len(normalized_shape)`` axes; ``weight`` and
    ``bias`` have shape ``normalized_shape`` (torch's names and shapes).
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        *,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
    ):
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        self.normalized_shape = tuple(int(d) for d in shape)
        if not self.normalized_shape or any(d <= 0 for d in self.normalized_shape):
            raise ValueError(f"normalized_shape must be positive sizes, got {normalized_shape!r}")
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(jnp.ones(self.normalized_shape, param_dtype))
        self.bias = nnx.Param(jnp.zeros(self.normalized_shape, param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        n = len(self.normalized_shape)
        if tuple(x.shape[-n:]) != self.normalized_shape:
            raise ValueError(
                f"LayerNorm over {self.normalized_shape} got an input of shape {x.shape}"
            )
        dtype = self.dtype or jnp.result_type(x, self.weight.get_value())
        axes = tuple(range(x.ndim - n, x.ndim))
        x32 = x.astype(jnp.float32)
        mean = x32.mean(axis=axes, keepdims=True)
        var = jnp.square(x32 - mean).mean(axis=axes, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight.get_value().astype(jnp.float32) + self.bias.get_value()
        return y.astype(dtype)


class SwishLayerNorm(nnx.Module):
    """Swish with layer normalisation: ``Y = X * sigmoid(LayerNorm(X))`` (TorchRec's).

    Args:
        input_dims: the trailing dimensions to normalise over (an int or a list:
            for an input ``[B, d1, d2, d3]``, ``[d2, d3]`` normalises the last two).
        dtype: computation dtype (default: the input's).
        param_dtype: dtype of the LayerNorm's ``weight`` and ``bias``.

    Example:
        >>> sln = SwishLayerNorm(100)
        >>> sln(jnp.ones((3, 100))).shape
        (3, 100)
    """

    def __init__(
        self,
        input_dims: int | Sequence[int],
        *,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
    ):
        # TorchRec: nn.Sequential(nn.LayerNorm(input_dims), nn.Sigmoid()), keys norm.0.*
        self.norm = nnx.Sequential(
            LayerNorm(input_dims, dtype=dtype, param_dtype=param_dtype), jax.nn.sigmoid
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * self.norm(x)


def resolve_activation(activation: Activation) -> Callable[[jax.Array], jax.Array]:
    """What one layer applies, given an activation as TorchRec's ``MLP`` accepts it.

    * ``"relu"`` / ``"sigmoid"``: ``jax.nn.relu`` / ``jax.nn.sigmoid``.
    * a callable taking one array (``jax.nn.relu``, an ``nnx.Module`` instance):
      used as is (a module instance is shared by every layer, as in torch).
    * a callable taking no arguments (``lambda: SwishLayerNorm(8)``): a factory,
      called once per layer so that layers do not share parameters; it must
      return an ``nnx.Module``.

    ``"swish_layernorm"`` needs the layer width, so ``MLP`` handles it itself.
    """
    if isinstance(activation, str):
        if activation not in _BY_NAME:
            raise ValueError(
                f"activation {activation!r} is not one of TorchRec's names "
                f"{[*_BY_NAME, 'swish_layernorm']}; pass a callable instead"
            )
        return _BY_NAME[activation]
    if not callable(activation):
        raise TypeError(f"activation must be a str or a callable, got {type(activation).__name__}")
    if isinstance(activation, nnx.Module) or not _takes_no_arguments(activation):
        return activation
    module = activation()
    if not isinstance(module, nnx.Module):
        raise ValueError(
            "an activation callable that takes no input must return an nnx.Module "
            f"(one per layer), but it returned {type(module).__name__}"
        )
    return module


def _takes_no_arguments(fn: Callable) -> bool:
    try:
        inspect.signature(fn).bind()
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins): an elementwise function
        return False
    return True


def identity(x: jax.Array) -> jax.Array:
    """``torch.nn.Identity``."""
    return x
