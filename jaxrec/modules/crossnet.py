"""Cross networks (DCN v1 / v2): TorchRec's ``torchrec.modules.crossnet``.

Every module maps ``[B, N] -> [B, N]``. Parameters keep TorchRec's names and
torch shapes (``kernels.<l>``, ``W_kernels.<l>``, ``bias.<l>``, ...), so a
TorchRec ``state_dict`` imports without reshaping. Kernels start
``xavier_normal`` and biases zero, as in TorchRec.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from .activation import Activation, resolve_activation
from .initializers import torch_linear, xavier_normal


def _check(in_features: int, num_layers: int, **positive: int) -> None:
    for name, value in {"in_features": in_features, **positive}.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"num_layers must be an int >= 0, got {num_layers!r}")


def _params(rngs: nnx.Rngs, num_layers: int, shape: tuple, init, dtype) -> nnx.List:
    return nnx.List([nnx.Param(init(rngs.params(), shape, dtype)) for _ in range(num_layers)])


def _zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


def _check_input(x: jax.Array, n: int, name: str) -> None:
    if x.ndim != 2 or x.shape[1] != n:
        raise ValueError(f"{name} expects input [batch_size, {n}], got {x.shape=}")


class CrossNet(nnx.Module):
    r"""Full-rank cross network: ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l``.

    ``W_l`` is ``[N, N]`` (``kernels.<l>``), ``b_l`` is ``[N, 1]`` (``bias.<l>``).

    Args:
        in_features: ``N``.
        num_layers: number of cross layers.
        rngs: ``nnx.Rngs`` for initialisation.
        param_dtype: parameter dtype.

    Example:
        >>> dcn = CrossNet(in_features=10, num_layers=2, rngs=nnx.Rngs(0))
        >>> dcn(jnp.ones((3, 10))).shape
        (3, 10)
    """

    def __init__(
        self,
        in_features: int,
        num_layers: int,
        *,
        rngs: nnx.Rngs,
        param_dtype: DTypeLike = jnp.float32,
    ):
        _check(in_features, num_layers)
        self._num_layers = num_layers
        self._in_features = in_features
        n = in_features
        self.kernels = _params(rngs, num_layers, (n, n), xavier_normal, param_dtype)
        self.bias = _params(rngs, num_layers, (n, 1), _zeros, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_input(x, self._in_features, "CrossNet")
        x0, xl = x, x
        for w, b in zip(self.kernels, self.bias, strict=True):
            xl = x0 * (xl @ w.get_value().T + b.get_value()[:, 0]) + xl
        return xl


class LowRankCrossNet(nnx.Module):
    r"""Low-rank cross network: ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``.

    ``W_l`` is ``[N, r]`` (``W_kernels.<l>``), ``V_l`` is ``[r, N]``
    (``V_kernels.<l>``), ``b_l`` is ``[N]`` (``bias.<l>``).

    Args:
        in_features: ``N``.
        num_layers: number of cross layers.
        low_rank: ``r >= 1`` (``r ~ N/4`` keeps most of full-rank accuracy).
        rngs: ``nnx.Rngs`` for initialisation.
        param_dtype: parameter dtype.

    Example:
        >>> dcn = LowRankCrossNet(in_features=10, num_layers=2, low_rank=3, rngs=nnx.Rngs(0))
        >>> dcn(jnp.ones((3, 10))).shape
        (3, 10)
    """

    def __init__(
        self,
        in_features: int,
        num_layers: int,
        low_rank: int = 1,
        *,
        rngs: nnx.Rngs,
        param_dtype: DTypeLike = jnp.float32,
    ):
        _check(in_features, num_layers, low_rank=low_rank)
        self._num_layers = num_layers
        self._low_rank = low_rank
        self._in_features = in_features
        n, r = in_features, low_rank
        self.W_kernels = _params(rngs, num_layers, (n, r), xavier_normal, param_dtype)
        self.V_kernels = _params(rngs, num_layers, (r, n), xavier_normal, param_dtype)
        self.bias = _params(rngs, num_layers, (n,), _zeros, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_input(x, self._in_features, "LowRankCrossNet")
        x0, xl = x, x
        for w, v, b in zip(self.W_kernels, self.V_kernels, self.bias, strict=True):
            xl_w = (xl @ v.get_value().T) @ w.get_value().T  # [B, r] -> [B, N]
            xl = x0 * (xl_w + b.get_value()) + xl
        return xl


class VectorCrossNet(nnx.Module):
    r"""DCN-v1 vector cross network: ``x_{l+1} = x_0 (x_l . w_l) + b_l + x_l``.

    ``w_l`` is ``[N, 1]`` (``kernels.<l>``), ``b_l`` is ``[N, 1]`` (``bias.<l>``).
    The bias is added outside the product, as TorchRec computes it (its
    docstring writes ``x_0 * (w . x_l + b)``).

    Args:
        in_features: ``N``.
        num_layers: number of cross layers.
        rngs: ``nnx.Rngs`` for initialisation.
        param_dtype: parameter dtype.

    Example:
        >>> dcn = VectorCrossNet(in_features=10, num_layers=2, rngs=nnx.Rngs(0))
        >>> dcn(jnp.ones((3, 10))).shape
        (3, 10)
    """

    def __init__(
        self,
        in_features: int,
        num_layers: int,
        *,
        rngs: nnx.Rngs,
        param_dtype: DTypeLike = jnp.float32,
    ):
        _check(in_features, num_layers)
        self._num_layers = num_layers
        self._in_features = in_features
        n = in_features
        self.kernels = _params(rngs, num_layers, (n, 1), xavier_normal, param_dtype)
        self.bias = _params(rngs, num_layers, (n, 1), _zeros, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_input(x, self._in_features, "VectorCrossNet")
        x0, xl = x, x
        for w, b in zip(self.kernels, self.bias, strict=True):
            xl = x0 * (xl @ w.get_value()) + b.get_value()[:, 0] + xl  # (x_l . w) is [B, 1]
        return xl


class LowRankMixtureCrossNet(nnx.Module):
    r"""DCN-v2 mixture of low-rank experts.

    ``x_{l+1} = sum_i softmax(gates(x_l))_i expert_i + x_l`` with
    ``expert_i = x_0 * (U_li g(C_li g(V_li x_l)) + b_l)``. ``U`` is
    ``[K, N, r]``, ``C`` ``[K, r, r]``, ``V`` ``[K, r, N]`` per layer,
    ``b_l`` ``[N, 1]``; gates are ``K`` bias-free ``Linear(N, 1)``
    (``gates.<i>.weight``). With one expert there is no gate.

    Args:
        in_features: ``N``.
        num_layers: number of cross layers.
        num_experts: ``K >= 1``.
        low_rank: ``r >= 1``.
        activation: ``g``: a callable (default ``jax.nn.relu``), ``"relu"``,
            ``"sigmoid"``, or an ``nnx.Module``.
        rngs: ``nnx.Rngs`` for initialisation.
        param_dtype: parameter dtype.

    Example:
        >>> dcn = LowRankMixtureCrossNet(10, 2, num_experts=5, low_rank=3, rngs=nnx.Rngs(0))
        >>> dcn(jnp.ones((3, 10))).shape
        (3, 10)
    """

    def __init__(
        self,
        in_features: int,
        num_layers: int,
        num_experts: int = 1,
        low_rank: int = 1,
        activation: Activation = jax.nn.relu,
        *,
        rngs: nnx.Rngs,
        param_dtype: DTypeLike = jnp.float32,
    ):
        _check(in_features, num_layers, num_experts=num_experts, low_rank=low_rank)
        self._num_layers = num_layers
        self._num_experts = num_experts
        self._low_rank = low_rank
        self._in_features = in_features
        k, n, r = num_experts, in_features, low_rank
        self.U_kernels = _params(rngs, num_layers, (k, n, r), xavier_normal, param_dtype)
        self.V_kernels = _params(rngs, num_layers, (k, r, n), xavier_normal, param_dtype)
        self.bias = _params(rngs, num_layers, (n, 1), _zeros, param_dtype)
        self.gates = (
            nnx.List(
                [
                    torch_linear(n, 1, bias=False, rngs=rngs, param_dtype=param_dtype)
                    for _ in range(k)
                ]
            )
            if k > 1
            else None
        )
        self._activation = resolve_activation(activation)
        self.C_kernels = _params(rngs, num_layers, (k, r, r), xavier_normal, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_input(x, self._in_features, "LowRankMixtureCrossNet")
        g = self._activation
        x0, xl = x, x
        for layer in range(self._num_layers):
            u = self.U_kernels[layer].get_value()
            c = self.C_kernels[layer].get_value()
            v = self.V_kernels[layer].get_value()
            e = g(jnp.einsum("krn,bn->bkr", v, xl))  # [B, K, r]
            e = g(jnp.einsum("krs,bks->bkr", c, e))  # [B, K, r]
            e = jnp.einsum("knr,bkr->bkn", u, e)  # [B, K, N]
            experts = x0[:, None, :] * (e + self.bias[layer].get_value()[:, 0])
            if self.gates is None:
                xl = experts[:, 0, :] + xl
            else:
                gating = jnp.concatenate([gate(xl) for gate in self.gates], axis=1)  # [B, K]
                weights = jax.nn.softmax(gating, axis=1)
                xl = jnp.einsum("bkn,bk->bn", experts, weights) + xl
        return xl
