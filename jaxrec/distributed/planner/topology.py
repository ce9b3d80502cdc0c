"""Topology: the devices a plan is made for (TorchRec's ``planner.types.Topology``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

GiB = 1024**3

# TorchRec's planner constants (``torchrec/distributed/planner/constants.py``), in bytes
# and bytes per second.
HBM_CAP = 32 * GiB
DDR_CAP = 128 * GiB
HBM_MEM_BW = 897 * GiB
DDR_MEM_BW = 51 * GiB
HBM_TO_DDR_MEM_BW = 32 * GiB  # host <-> device copies (PCIe); TorchRec's "may be shared"
INTRA_HOST_BW = 600 * GiB
CROSS_HOST_BW = 12.5 * GiB
BATCH_SIZE = 512

# Nominal HBM bandwidths (vendor datasheets) for Topology.from_devices, by device_kind
# substring; unknown kinds keep TorchRec's default.
_KNOWN_HBM_BW = (
    ("H200", 4.8e12),
    ("H100", 3.35e12),
    ("A100", 2.0e12),
    ("TPU v5p", 2.76e12),
    ("TPU v5 lite", 0.82e12),
    ("TPU v4", 1.2e12),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """Devices, their memory and bandwidths, and the per-device batch size.

    Defaults are TorchRec's (32 GiB HBM, 128 GiB host DDR, 897 GiB/s HBM,
    32 GiB/s between host and device, 600 GiB/s within a host, 12.5 GiB/s
    across hosts, batch 512 per device).
    Ranks are flat device indices; a host is ``local_world_size`` consecutive
    ranks (the last mesh axis, as the plan builders assume).

    Attributes:
        world_size: number of devices.
        local_world_size: devices per host (default: all on one host).
        compute_device: ``"cuda"``, ``"tpu"``, ``"cpu"`` (for printing).
        hbm_cap: bytes of device memory per device.
        ddr_cap: bytes of host memory per host (TorchRec's is per device): it
            holds the tables of ``fused_uvm_caching`` shards on the host's ranks.
        hbm_mem_bw, ddr_mem_bw: bytes/s of device and host memory.
        hbm_to_ddr_mem_bw: bytes/s of one device's copies to and from host
            memory (TorchRec's name): cache misses and evictions move at this rate.
        intra_host_bw, cross_host_bw: bytes/s per device for collectives.
        batch_size: samples per device per step.

    TorchRec's ``bwd_compute_multiplier`` has no counterpart: the backward is
    costed from the bytes jaxrec's fused update moves.

    Example:
        >>> Topology(world_size=8, hbm_cap=16 * GiB, batch_size=1024).num_hosts
        1
    """

    world_size: int
    local_world_size: int | None = None
    compute_device: str = "cuda"
    hbm_cap: int = HBM_CAP
    ddr_cap: int = DDR_CAP
    hbm_mem_bw: float = HBM_MEM_BW
    ddr_mem_bw: float = DDR_MEM_BW
    hbm_to_ddr_mem_bw: float = HBM_TO_DDR_MEM_BW
    intra_host_bw: float = INTRA_HOST_BW
    cross_host_bw: float = CROSS_HOST_BW
    batch_size: int = BATCH_SIZE

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        local = self.world_size if self.local_world_size is None else self.local_world_size
        if local < 1 or self.world_size % local:
            raise ValueError(f"local_world_size={local} must divide world_size={self.world_size}")
        object.__setattr__(self, "local_world_size", local)
        for f in (
            "hbm_cap",
            "ddr_cap",
            "hbm_mem_bw",
            "ddr_mem_bw",
            "hbm_to_ddr_mem_bw",
            "intra_host_bw",
            "cross_host_bw",
            "batch_size",
        ):
            if not getattr(self, f) > 0:
                raise ValueError(f"Topology.{f} must be positive, got {getattr(self, f)!r}")

    @property
    def ranks_per_host(self) -> int:
        """``local_world_size`` as resolved by construction (never ``None``)."""
        local = self.local_world_size
        assert local is not None, "Topology.__post_init__ resolves local_world_size"
        return local

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.ranks_per_host

    def host_ranks(self, host: int) -> range:
        lo = self.ranks_per_host
        return range(host * lo, (host + 1) * lo)

    def all_to_all_seconds_per_byte(self) -> float:
        """Seconds per byte of a device's all_to_all buffer (``N`` equal blocks).

        The block a device keeps costs nothing; ``L - 1`` blocks cross the host's
        links and ``N - L`` cross hosts.
        """
        n, lo = self.world_size, self.ranks_per_host
        return (lo - 1) / n / self.intra_host_bw + (n - lo) / n / self.cross_host_bw

    def gather_seconds_per_byte(self) -> float:
        """Seconds per byte of one peer's block in an all_gather (``N - 1`` peers)."""
        n, lo = self.world_size, self.ranks_per_host
        return (lo - 1) / self.intra_host_bw + (n - lo) / self.cross_host_bw

    def ppermute_seconds_per_byte(self) -> float:
        """Seconds per byte sent to one peer (across hosts when there are several: the
        peers a planner pairs are not known to share a host)."""
        return 1 / (self.cross_host_bw if self.num_hosts > 1 else self.intra_host_bw)

    @staticmethod
    def from_devices(
        devices: Sequence[Any] | None = None,  # jax.Device, which pyright takes for no type
        *,
        local_world_size: int | None = None,
        **overrides: Any,
    ) -> Topology:
        """A topology for JAX devices (default ``jax.devices()``), in their order.

        Reads what JAX exposes: the device count, devices per process (as
        ``local_world_size``), the platform, ``memory_stats()["bytes_limit"]``
        as HBM capacity (GPU/TPU), a nominal HBM bandwidth for known device
        kinds and this host's physical memory as ``ddr_cap``. Everything else
        keeps TorchRec's defaults; ``overrides`` (any field, e.g.
        ``batch_size=4096``) win.
        """
        import jax

        devs = list(jax.devices() if devices is None else devices)
        if not devs:
            raise ValueError("from_devices needs at least one device")
        fields: dict[str, Any] = {"world_size": len(devs)}
        if local_world_size is None:
            first = devs[0].process_index
            local_world_size = sum(1 for d in devs if d.process_index == first)
        fields["local_world_size"] = local_world_size
        fields["compute_device"] = devs[0].platform
        stats = None
        try:
            stats = devs[0].memory_stats()
        except Exception:  # noqa: BLE001 (backends without memory stats raise varied errors)
            stats = None
        if stats and stats.get("bytes_limit"):
            fields["hbm_cap"] = int(stats["bytes_limit"])
        with contextlib.suppress(ValueError, OSError, AttributeError):  # not POSIX: default
            fields["ddr_cap"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        kind = str(getattr(devs[0], "device_kind", ""))
        for name, bw in _KNOWN_HBM_BW:
            if name.lower() in kind.lower():
                fields["hbm_mem_bw"] = bw
                break
        fields.update(overrides)
        return Topology(**fields)
