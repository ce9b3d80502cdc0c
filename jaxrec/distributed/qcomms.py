"""Reduced-precision embedding communication (TorchRec's ``QCommsConfig``).

The pooled blocks (or sequence rows) a shard sends back and the output
gradients sent to the shards can travel in fp16 or bf16: each payload is cast
before its ``all_to_all`` and back to float32 on arrival, where row shards are
summed and the fused update runs (fp32 accumulation). Ids always travel as
int32. Halving the embedding payloads halves most of a step's communication;
the cost is one rounding of each partial sum and of each output gradient.
fp16 has little range: gradients below about 6e-5 lose precision, and below
6e-8 vanish; bf16 keeps float32's range with fewer bits, or give fp16 a
``backward_loss_scale`` (TorchRec's name: gradients are multiplied by it
before the cast and divided after).
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp


class CommType(enum.Enum):
    """Payload precisions (TorchRec's ``CommType`` names; FP8/INT8 are not offered)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"


_DTYPES = {CommType.FP32: jnp.float32, CommType.FP16: jnp.float16, CommType.BF16: jnp.bfloat16}


def _comm_type(value, field: str) -> CommType:
    try:
        return value if isinstance(value, CommType) else CommType(str(value).lower())
    except ValueError:
        raise ValueError(
            f"QCommsConfig.{field}: unknown precision {value!r}; use one of "
            f"{[c.value for c in CommType]}"
        ) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class QCommsConfig:
    """Precisions of the forward (pooled blocks / rows) and backward (gradients) payloads,
    and an optional loss scale for the backward payloads.

    Example:
        >>> q = QCommsConfig(forward_precision="fp16", backward_precision="bf16")
        >>> q.forward_precision, q.backward_precision
        (<CommType.FP16: 'fp16'>, <CommType.BF16: 'bf16'>)
    """

    forward_precision: CommType | str = CommType.FP32
    backward_precision: CommType | str = CommType.FP32
    backward_loss_scale: float | None = None

    def __post_init__(self):
        for f in ("forward_precision", "backward_precision"):
            object.__setattr__(self, f, _comm_type(getattr(self, f), f))
        s = self.backward_loss_scale
        if s is not None and not (isinstance(s, int | float) and s > 0 and s < float("inf")):
            raise ValueError(f"QCommsConfig.backward_loss_scale must be positive, got {s!r}")

    @property
    def forward_dtype(self):
        return _DTYPES[CommType(self.forward_precision)]  # a CommType since __post_init__

    @property
    def backward_dtype(self):
        return _DTYPES[CommType(self.backward_precision)]  # a CommType since __post_init__


FP32_COMMS = QCommsConfig()
