"""Table configurations (TorchRec's ``embedding_configs``), as frozen dataclasses."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


class PoolingType(enum.Enum):
    SUM = "SUM"
    MEAN = "MEAN"
    NONE = "NONE"


class DataType(enum.Enum):
    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"


_DTYPES = {DataType.FP32: jnp.float32, DataType.FP16: jnp.float16, DataType.BF16: jnp.bfloat16}


def data_type_to_dtype(data_type: DataType) -> DTypeLike:
    """The JAX dtype a table of ``data_type`` is stored in."""
    return _DTYPES[data_type]


# init_fn(key, shape, dtype) -> array, flax's initializer signature.
InitFn = Callable[[jax.Array, tuple[int, ...], DTypeLike], jax.Array]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaseEmbeddingConfig:
    """Fields shared by pooled and sequence tables (TorchRec's names and defaults).

    ``feature_names`` defaults to ``(name,)``. ``init_fn`` is a flax-style
    initializer ``init_fn(key, shape, dtype)``; without it rows are uniform in
    ``[weight_init_min, weight_init_max]``, which default to
    ``-+sqrt(1 / num_embeddings)`` as in TorchRec.

    ``cached_rows`` (jaxrec's, set by ``jaxrec.cache.cached_configs`` /
    ``device_plan``): this table is a device cache of ``num_embeddings`` slots for a
    host table of ``cached_rows`` rows, so checkpoints save and restore it only with
    its host table (``RowCache.save``).
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: Sequence[str] = ()
    weight_init_max: float | None = None
    weight_init_min: float | None = None
    init_fn: InitFn | None = None
    cached_rows: int | None = None

    def __post_init__(self):
        for field in ("num_embeddings", "embedding_dim", "cached_rows"):
            value = getattr(self, field)
            if field == "cached_rows" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"{field} must be a positive int, got {field}={value!r} in table {self.name!r}"
                )
        if not self.name:
            raise ValueError("every table needs a name (it keys state_dict entries); pass name=...")
        if not isinstance(self.data_type, DataType):
            raise TypeError(
                f"data_type must be a DataType, got {self.data_type!r} in table {self.name!r}"
            )
        if isinstance(self.feature_names, str):
            raise TypeError(
                f"feature_names must be a list of str, got the string {self.feature_names!r}; "
                "wrap it in a list"
            )
        names = tuple(self.feature_names) or (self.name,)
        dup = sorted({f for f in names if names.count(f) > 1})
        if dup:
            raise ValueError(f"table {self.name!r} lists features {dup} more than once")
        object.__setattr__(self, "feature_names", names)
        lo, hi = self.get_weight_init_min(), self.get_weight_init_max()
        if not lo <= hi:
            raise ValueError(f"weight_init_min={lo} > weight_init_max={hi} in table {self.name!r}")

    def get_weight_init_max(self) -> float:
        if self.weight_init_max is None:
            return math.sqrt(1 / self.num_embeddings)
        return self.weight_init_max

    def get_weight_init_min(self) -> float:
        if self.weight_init_min is None:
            return -math.sqrt(1 / self.num_embeddings)
        return self.weight_init_min

    def num_features(self) -> int:
        return len(self.feature_names)

    @property
    def dtype(self) -> DTypeLike:
        return data_type_to_dtype(self.data_type)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingBagConfig(BaseEmbeddingConfig):
    """A pooled table: each bag of ids becomes one vector (SUM or MEAN)."""

    pooling: PoolingType = PoolingType.SUM

    def __post_init__(self):
        super().__post_init__()
        if self.pooling not in (PoolingType.SUM, PoolingType.MEAN):
            raise ValueError(
                f"EmbeddingBagConfig {self.name!r} needs pooling SUM or MEAN, got {self.pooling}; "
                "use EmbeddingConfig for unpooled (sequence) lookups"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingConfig(BaseEmbeddingConfig):
    """A sequence table: every id keeps its own vector (no pooling)."""


def get_embedding_names_by_table(tables: Sequence[BaseEmbeddingConfig]) -> list[list[str]]:
    """Output names per table, as TorchRec makes them.

    A feature read by one table keeps its name; a feature read by several
    tables becomes ``"<feature>@<table>"`` in each.
    """
    count: dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            count[f] = count.get(f, 0) + 1
    return [[f if count[f] == 1 else f"{f}@{t.name}" for f in t.feature_names] for t in tables]


def check_tables(tables: Sequence[BaseEmbeddingConfig], kind: type) -> tuple:
    """Validates a collection's table list: right config type, unique names."""
    tables = tuple(tables)
    if not tables:
        raise ValueError("a collection needs at least one table config")
    for t in tables:
        if not isinstance(t, kind):
            raise TypeError(f"expected {kind.__name__} entries, got {type(t).__name__} for {t!r}")
    names = [t.name for t in tables]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate table names {dup}; table names must be unique")
    return tables
