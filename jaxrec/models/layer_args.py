"""The keyword arguments every layer of a model takes, passed on as ``**kw``."""

from __future__ import annotations

from typing import TypedDict

from flax import nnx
from jax.typing import DTypeLike


class LayerArgs(TypedDict):
    """``rngs``, ``dtype`` and ``param_dtype`` as flax's layers take them."""

    rngs: nnx.Rngs
    dtype: DTypeLike | None  # a dtype-like (jnp.float32, "bfloat16", ...) or None: as the inputs
    param_dtype: DTypeLike  # a dtype-like
