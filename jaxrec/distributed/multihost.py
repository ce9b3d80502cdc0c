"""Multi-process (multi-host) runs: starting JAX's distributed runtime, and which
devices each process feeds.

JAX runs one program per process (one per host, or one per GPU under ``srun``)
over a mesh of every process's devices; each process feeds only its own
devices (:func:`~jaxrec.distributed.shard_batch` of its local batches).
TorchRec's counterpart is ``torch.distributed.init_process_group`` under
``torchrun``. On CPU, the processes' collectives go over gloo (JAX's default).
"""

from __future__ import annotations

import os
from typing import TypedDict

import jax

from . import peers

# What launchers set in each process they start (JAX's cluster detection reads the
# same variables): the name of the launcher and its process count variable.
_SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
_OMPI = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")


def launched_processes() -> int | None:
    """The process count a launcher's environment declares: ``srun`` (SLURM_NTASKS
    inside a job step) or Open MPI's ``mpirun`` (OMPI_COMM_WORLD_SIZE); ``None``
    outside both (a plain ``python`` run, or ``salloc``'s shell before ``srun``)."""
    env = os.environ
    for names, count in ((_SLURM, "SLURM_NTASKS"), (_OMPI, "OMPI_COMM_WORLD_SIZE")):
        if all(n in env for n in names):
            try:
                return int(env[count])
            except ValueError:
                raise ValueError(f"{count}={env[count]!r} is not a process count") from None
    return None


class _InitArgs(TypedDict, total=False):
    """The keywords :func:`initialize` passes to ``jax.distributed.initialize``."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    heartbeat_timeout_seconds: int


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    heartbeat_timeout_s: int | None = None,
    gloo_interface: str | None = None,
) -> bool:
    """Starts JAX's distributed runtime when the run has several processes.

    Call it first, before anything starts JAX's backend (``jax.devices()``, an
    array): ``jax.distributed.initialize`` must come first. Then
    ``jax.devices()`` lists every process's devices; each process feeds its own
    (:func:`process_ranks`).

    Where the processes come from, in order:

    * the arguments: ``num_processes`` with ``process_id`` and
      ``coordinator_address`` (``host:port`` of process 0; or the
      ``JAX_COORDINATOR_ADDRESS`` variable);
    * ``auto=True``: ``jax.distributed.initialize()`` without arguments, so JAX
      detects the cluster (SLURM, Open MPI, Cloud TPU, Kubernetes; or
      ``JAX_COORDINATOR_ADDRESS`` with a detectable process id);
    * otherwise, when a launcher's environment declares several processes
      (:func:`launched_processes`: ``srun``, ``mpirun``), the same detection.

    With none of these, or one process, it does nothing (a one-process run).

    Args:
        coordinator_address: ``"host:port"`` that process 0 listens on and every
            process reaches (``127.0.0.1:<free port>`` on one machine).
        num_processes: how many processes the run has.
        process_id: this process's index, ``0 <= process_id < num_processes``.
        auto: always let JAX detect the cluster (launchers this function does not
            recognise).
        heartbeat_timeout_s: how long a silent process counts as alive (JAX's
            ``heartbeat_timeout_seconds``; default: JAX's, 100 s). When one dies,
            every other process is ended within about this long, even one that
            waits outside a collective; one blocked in a collective with it fails
            at once (``lost_process`` names it).
        gloo_interface: the network interface the CPU collectives (gloo) bind to,
            e.g. ``"eth0"``; default: ``GLOO_SOCKET_IFNAME``, else the address the
            host name resolves to (JAX's behaviour).

    Returns:
        Whether the distributed runtime was started (several processes).

    Raises:
        ValueError: an incomplete or inconsistent set of arguments (the message
            says what is missing).
        RuntimeError: JAX's backend already started, or the runtime did not start
            (JAX's message, with the addresses and ids this process used).

    Warns (``RuntimeWarning``) when gloo would bind to a loopback address while
    the coordinator is on another host.

    Example::

        import jaxrec.distributed as dist
        dist.initialize("10.0.0.1:1234", num_processes=2, process_id=rank)
        mesh = jax.make_mesh((jax.device_count(),), ("x",))
    """
    explicit = (coordinator_address, num_processes, process_id) != (None, None, None)
    if explicit:
        coordinator_address = _check_process_args(coordinator_address, num_processes, process_id)
        if num_processes == 1:
            return False
        kwargs = _InitArgs(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
    elif auto or (launched_processes() or 1) > 1:
        kwargs = _InitArgs()
    else:
        return False
    if heartbeat_timeout_s is not None:
        if heartbeat_timeout_s < 1:
            raise ValueError(f"heartbeat_timeout_s must be at least 1, got {heartbeat_timeout_s}")
        kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout_s)
    if jax.distributed.is_initialized():
        raise RuntimeError("jax.distributed is already initialized: call initialize once")
    interface = gloo_interface or os.environ.get("GLOO_SOCKET_IFNAME") or None
    if interface:  # (checked before connecting; used when the CPU backend starts)
        peers.use_gloo_interface(interface)
    try:
        jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError) as e:
        how = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "JAX's cluster detection"
        raise RuntimeError(f"jax.distributed.initialize({how}) failed: {e}") from e
    peers.publish_address(interface)
    return True


def _check_process_args(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> str | None:
    """Validates :func:`initialize`'s explicit arguments (before any process connects,
    so a typo fails at once instead of timing out); returns the coordinator address
    (the argument or ``JAX_COORDINATOR_ADDRESS``)."""
    if num_processes is None:
        raise ValueError(
            "num_processes is required with process_id or coordinator_address "
            f"(got {process_id=}, {coordinator_address=})"
        )
    if num_processes < 1:
        raise ValueError(f"num_processes must be at least 1, got {num_processes=}")
    if num_processes == 1:
        if process_id not in (None, 0):
            raise ValueError(f"one process has process_id 0, got {process_id=}")
        return coordinator_address
    if process_id is None:
        raise ValueError(
            f"num_processes={num_processes} needs this process's process_id "
            f"(0 .. {num_processes - 1})"
        )
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must lie in [0, {num_processes}), got {process_id=}")
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address:
        raise ValueError(
            f"num_processes={num_processes} needs coordinator_address ('host:port' of process "
            "0, the same for every process) or the JAX_COORDINATOR_ADDRESS variable"
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator_address must be 'host:port', got {address!r}")
    return address


# jax.Device aliases a compiled (stub-less) class: pyright sees a variable, not a type.
def mesh_devices(n: int) -> list[jax.Device]:  # pyright: ignore[reportInvalidTypeForm]
    """``n`` devices for a one-axis mesh: ``n / process_count`` from each process,
    process 0's first, so that each process feeds a contiguous block of ranks.

    With one process: ``jax.devices()[:n]``.

    Raises:
        ValueError: ``n`` is not a multiple of the process count, or a process
            has fewer than ``n / process_count`` devices.
    """
    if n < 1:
        raise ValueError(f"a mesh needs at least one device, got {n}")
    procs = jax.process_count()
    if n % procs:
        raise ValueError(
            f"{n} devices cannot be split evenly over {procs} processes: use a multiple of {procs}"
        )
    if n > jax.device_count():
        raise ValueError(f"{n} devices asked for: only {jax.device_count()} are visible")
    per = n // procs
    devices = []
    for p in range(procs):
        own = sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        if len(own) < per:
            raise ValueError(
                f"process {p} has {len(own)} devices; {n} devices over {procs} processes "
                f"need {per} each"
            )
        devices += own[:per]
    return devices


def process_ranks(mesh: jax.sharding.Mesh) -> list[int]:
    """The positions (ranks, in the mesh's flat order) of this process's devices:
    the per-device batches this process supplies to ``shard_batch``."""
    me = jax.process_index()
    return [i for i, d in enumerate(mesh.devices.flat) if d.process_index == me]
