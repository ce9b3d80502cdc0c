"""PyTorch's default initialisations, as flax initializers.

TorchRec's dense modules use ``torch.nn.Linear`` (Kaiming-uniform with
``a=sqrt(5)``: weights and biases uniform in ``+-1/sqrt(fan_in)``) and
``xavier_normal_`` for cross-net kernels, with torch's fan rule for tensors of
rank 3 and more (``fan_in = shape[1] * prod(shape[2:])``,
``fan_out = shape[0] * prod(shape[2:])``). These reproduce the distributions,
not torch's random streams (uniform draws go through ``jaxrec.ops.init``: one
compiled program for every layer shape, so a model builds without compiling per
layer): to reproduce a TorchRec model's numbers, import its
weights with :func:`jaxrec.modules.load_torchrec_state_dict`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from ..ops.init import uniform


def torch_fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(fan_in, fan_out)`` as ``torch.nn.init`` computes them for a torch-layout tensor."""
    if len(shape) < 2:
        raise ValueError(f"fans need a tensor of rank >= 2, got {shape=}")
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def xavier_normal(
    key: jax.Array, shape: tuple[int, ...], dtype: DTypeLike = jnp.float32
) -> jax.Array:
    """``torch.nn.init.xavier_normal_``: normal with std ``sqrt(2 / (fan_in + fan_out))``."""
    fan_in, fan_out = torch_fans(tuple(shape))
    std = math.sqrt(2.0 / (fan_in + fan_out))
    # A flat draw: XLA:CPU compiles a rank-3 normal draw ~5x slower than a flat one.
    flat = jax.random.normal(key, (math.prod(shape),), jnp.float32)
    return (std * flat).reshape(shape).astype(dtype)


def torch_linear_kernel_init() -> nnx.Initializer:
    """``torch.nn.Linear``'s weight init for a flax ``[in, out]`` kernel: U(+-1/sqrt(in))."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: DTypeLike = jnp.float32) -> jax.Array:
        bound = 1.0 / math.sqrt(shape[0]) if shape[0] > 0 else 0.0
        return uniform(key, shape, -bound, bound, dtype)

    return init


def torch_linear_bias_init(fan_in: int) -> nnx.Initializer:
    """``torch.nn.Linear``'s bias init: U(+-1/sqrt(fan_in)) (zeros when ``fan_in == 0``)."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0

    def init(key: jax.Array, shape: tuple[int, ...], dtype: DTypeLike = jnp.float32) -> jax.Array:
        return uniform(key, shape, -bound, bound, dtype)

    return init


def torch_linear(
    in_features: int,
    out_features: int,
    bias: bool = True,
    *,
    rngs: nnx.Rngs,
    dtype: DTypeLike | None = None,
    param_dtype: DTypeLike = jnp.float32,
) -> nnx.Linear:
    """An ``nnx.Linear`` initialised like ``torch.nn.Linear(in_features, out_features, bias)``.

    Its kernel is ``[in, out]``: torch's ``weight`` transposed (the TorchRec
    weight import transposes it).
    """
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=torch_linear_kernel_init(),
        bias_init=torch_linear_bias_init(in_features),
        rngs=rngs,
    )
