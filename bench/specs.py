"""Argument specs shared by the benchmarks and their tests, in FBGEMM's parameter names.

A ``LookupSpec`` describes one pooled-lookup workload as FBGEMM's TBE benchmark
does: ``T`` tables of ``E`` rows and dim ``D``, a batch of ``B`` samples with
exactly ``L`` ids per bag, ids uniform (``alpha=0``) or Zipf-distributed.
Small presets double as correctness tests in CI.
"""

from __future__ import annotations

import dataclasses

import numpy as np

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
POOLINGS = ("SUM", "MEAN")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LookupSpec:
    """One pooled-lookup workload.

    Attributes:
        T: number of tables, one feature each.
        E: rows per table.
        D: embedding dim.
        B: batch size.
        L: ids per bag (fixed, as FBGEMM's default benchmark).
        alpha: Zipf exponent of the id distribution; 0 is uniform.
        weighted: per-sample weights (uniform in ``[0, 1)``).
        dtype: table dtype, ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        pooling: ``"SUM"`` or ``"MEAN"``.
    """

    T: int
    E: int
    D: int
    B: int
    L: int
    alpha: float = 0.0
    weighted: bool = False
    dtype: str = "fp32"
    pooling: str = "SUM"

    def __post_init__(self):
        for field in ("T", "E", "D", "B", "L"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {field}={value!r}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0 (0 is uniform), got alpha={self.alpha}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def bytes_read(self) -> int:
        """Forward bytes read as FBGEMM counts them: ``B * T * L * D * bytes``."""
        return self.B * self.T * self.L * self.D * self.bytes_per_element

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


PRESETS: dict[str, LookupSpec] = {
    # CI-sized: a correctness test against TorchRec as well as a benchmark.
    "tiny": LookupSpec(T=2, E=1000, D=16, B=32, L=4),
    "tiny_weighted": LookupSpec(T=2, E=1000, D=16, B=32, L=4, alpha=1.1, weighted=True),
    "tiny_mean_fp16": LookupSpec(T=2, E=1000, D=16, B=32, L=4, dtype="fp16", pooling="MEAN"),
    "small": LookupSpec(T=4, E=100_000, D=64, B=1024, L=20),
    # FBGEMM's split_table_batched_embeddings_benchmark defaults.
    "default": LookupSpec(T=8, E=1_000_000, D=128, B=4096, L=20),
    "default_zipf": LookupSpec(T=8, E=1_000_000, D=128, B=4096, L=20, alpha=1.15),
}


def zipf_ids(rng: np.random.Generator, E: int, alpha: float, size: int) -> np.ndarray:
    """``size`` ids in ``[0, E)`` with ``P(rank k) ~ k**-alpha``, by inverse CDF.

    Samples the continuous bounded power law on ``[1, E + 1)`` and floors it, so
    any ``alpha > 0`` works and nothing is rejected. Ranks are scattered over
    the table by a fixed bijection (multiplication by a constant coprime to
    ``E``) so that hot rows are not adjacent in memory.
    """
    u = rng.random(size)
    if abs(alpha - 1.0) < 1e-9:
        x = np.exp(u * np.log(E + 1.0))
    else:
        a = 1.0 - alpha
        x = (1.0 + u * ((E + 1.0) ** a - 1.0)) ** (1.0 / a)
    rank = np.minimum(x.astype(np.int64) - 1, E - 1)  # 0-based; guard rounding at E
    return _scatter(rank, E)


def _scatter(rank: np.ndarray, E: int) -> np.ndarray:
    mult = 2_654_435_761  # Knuth's golden-ratio constant; made coprime to E below
    while np.gcd(mult, E) != 1:
        mult += 2
    return (rank * (mult % E)) % E if E > 1 else rank


def make_inputs(spec: LookupSpec, seed: int = 0) -> dict[str, np.ndarray | list[str] | None]:
    """Deterministic lookup inputs in TorchRec's KJT layout.

    Args:
        spec: the workload.
        seed: numpy seed; same seed and spec give the same inputs.

    Returns:
        A dict with ``keys`` (``["f0", ...]``, one feature per table ``"t<i>"``),
        ``values`` ``[T * B * L]`` int64 ids, packed key-major, ``lengths``
        ``[T * B]`` int32 (all ``L``), and ``weights`` ``[T * B * L]`` float32
        or ``None``.
    """
    rng = np.random.default_rng(seed)
    n = spec.T * spec.B * spec.L
    if spec.alpha == 0:
        values = rng.integers(0, spec.E, size=n, dtype=np.int64)
    else:
        values = zipf_ids(rng, spec.E, spec.alpha, n)
    weights = rng.random(n, dtype=np.float32) if spec.weighted else None
    return {
        "keys": [f"f{t}" for t in range(spec.T)],
        "values": values,
        "lengths": np.full(spec.T * spec.B, spec.L, np.int32),
        "weights": weights,
    }
