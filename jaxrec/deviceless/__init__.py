"""Compiling for GPUs that are not there: XLA's GPU compiler on a CPU-only machine.

With the CUDA plugin installed (``pip install "jax[cuda13-local]"``), ``ptxas``
on ``PATH`` and ``JAX_PLATFORMS=cpu``, JAX can build a *compile-only* GPU
topology from a target description, and ``jax.jit(f).trace(*abstract).lower()
.compile()`` then runs the whole GPU pipeline: XLA's GPU passes (SPMD
partitioning, collectives, fusion, memory assignment), Pallas -> Triton -> PTX
and ``ptxas`` for ``sm_90a``. Nothing is allocated and nothing runs, so tables
of any size can be compiled from ``jax.ShapeDtypeStruct`` s.

What this checks that lowering alone does not: Triton and ``ptxas`` failures
(shared memory or registers over the limit, unsupported ops), XLA's GPU
collective choices, and per-device memory (``compiled.memory_analysis()``).

Example:
    >>> topo = deviceless.topology("1x1x8")  # one host, 8 H100s
    >>> mesh = deviceless.mesh(topo, ("model",))
    >>> table = deviceless.abstract((80_000_000, 128), "float32", mesh, P("model"))
    >>> compiled = jax.jit(f).trace(table).lower().compile(deviceless.COMPILER_OPTIONS)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from importlib import resources

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

REPLICATED = PartitionSpec()
# Pass to ``.compile(compiler_options=...)``. XLA rewrites sorts of more than
# 16,384 keys (the sparse update's id sort) into CUB's radix sort, whose scratch
# size it asks the CUDA runtime for: without a device that fails with
# "cudaErrorInvalidDevice: invalid device ordinal". Without CUB, XLA compiles
# its own sort kernels; everything else is unchanged, but memory_analysis's
# temporaries then lack CUB's scratch (about the sorted keys and values again).
COMPILER_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}
TARGETS = ("h100_sxm",)  # target descriptions shipped here (XLA's, gpu_device_info only)


class UnavailableError(RuntimeError):
    """Deviceless GPU compilation cannot run on this machine (says what is missing)."""


def target_config(target: str = "h100_sxm") -> str:
    """The ``GpuTargetConfig`` text proto of a shipped target."""
    if target not in TARGETS:
        raise ValueError(f"unknown GPU target {target!r}; shipped targets: {TARGETS}")
    return resources.files(__name__).joinpath(f"{target}.txtpb").read_text()  # this package


def unavailable_reason() -> str | None:
    """Why deviceless compilation cannot run here, or None when it can."""
    try:
        import jax_plugins.xla_cuda13  # noqa: F401
    except ImportError:
        return 'the CUDA plugin is not installed: pip install "jax[cuda13-local]==0.10.2"'
    if not any(
        os.access(os.path.join(p, "ptxas"), os.X_OK) for p in os.environ["PATH"].split(os.pathsep)
    ):
        return "ptxas is not on PATH (install the CUDA toolkit, or the nvidia-cuda-nvcc wheel)"
    return None


@functools.cache
def topology(shape: str = "1x1x8", target: str = "h100_sxm") -> topologies.TopologyDescription:
    """A compile-only CUDA topology: ``"<slices>x<hosts>x<gpus per host>"``.

    ``"1x1x8"`` is one host with 8 GPUs; ``"1x2x4"`` two hosts with 4 each
    (devices of different processes: what host-based sharding types see).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise UnavailableError(f"cannot compile for GPUs without one here: {reason}")
    try:
        return topologies.get_topology_desc(
            platform="cuda", topology=shape, target_config=target_config(target)
        )
    except Exception as e:  # the plugin's errors name neither the fix nor JAX_PLATFORMS
        raise UnavailableError(
            f"could not build the CUDA topology {shape!r} ({e}); run with JAX_PLATFORMS=cpu "
            "so that the CUDA plugin registers without looking for a GPU"
        ) from e


def mesh(
    topo: topologies.TopologyDescription,
    axis_names: Sequence[str] = ("model",),
    shape: Sequence[int] | None = None,
) -> Mesh:
    """A mesh over every device of ``topo`` (one axis unless ``shape`` says otherwise)."""
    shape = (len(topo.devices),) if shape is None else tuple(shape)
    if int(np.prod(shape)) != len(topo.devices):
        raise ValueError(f"mesh shape {shape} does not hold the {len(topo.devices)} devices")
    return topologies.make_mesh(topo, shape, tuple(axis_names))


def abstract(shape, dtype, mesh: Mesh, spec: PartitionSpec = REPLICATED):
    """A ``jax.ShapeDtypeStruct`` placed on ``mesh`` (nothing is allocated)."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, spec))


def abstract_like(tree, mesh: Mesh, spec: PartitionSpec = REPLICATED):
    """``tree``'s arrays (or shape structs) as abstract values on ``mesh``, all with ``spec``."""
    return jax.tree.map(lambda x: abstract(x.shape, x.dtype, mesh, spec), tree)
