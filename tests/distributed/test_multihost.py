"""jaxrec.distributed's multi-process entry points, in one process (no runtime is started).

The two-process run itself is tested through the job (tests/jobs/test_multihost_job.py)
and the sharded collections (test_multiprocess.py).
"""

import jax
import pytest

from jaxrec import distributed as dist
from jaxrec.distributed import peers

SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "4"}
SLURM |= {"SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
OMPI = {"OMPI_MCA_orte_hnp_uri": "1.2.3.4:5", "OMPI_COMM_WORLD_SIZE": "3"}
OMPI |= {"OMPI_COMM_WORLD_RANK": "0"}


@pytest.fixture
def clean_env(monkeypatch):
    for name in [*SLURM, *OMPI, "JAX_COORDINATOR_ADDRESS"]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_launched_processes_reads_srun_and_mpirun(clean_env):
    assert dist.launched_processes() is None
    clean_env.setenv("SLURM_JOB_ID", "7")  # salloc's shell, no job step: one process
    assert dist.launched_processes() is None
    for name, value in SLURM.items():
        clean_env.setenv(name, value)
    assert dist.launched_processes() == 4
    for name in SLURM:
        clean_env.delenv(name)
    for name, value in OMPI.items():
        clean_env.setenv(name, value)
    assert dist.launched_processes() == 3


def test_one_process_starts_nothing(clean_env):
    assert dist.initialize() is False
    assert dist.initialize(num_processes=1) is False
    assert dist.initialize("127.0.0.1:1234", 1, 0) is False
    assert not jax.distributed.is_initialized()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(process_id=0), "num_processes is required"),
        (dict(coordinator_address="h:1"), "num_processes is required"),
        (dict(num_processes=0), "at least 1"),
        (dict(num_processes=1, process_id=1), "process_id 0"),
        (dict(num_processes=2, coordinator_address="h:1"), "needs this process's process_id"),
        (dict(num_processes=2, process_id=-1, coordinator_address="h:1"), r"\[0, 2\)"),
        (dict(num_processes=2, process_id=0), "needs coordinator_address"),
        (dict(num_processes=2, process_id=0, coordinator_address="h:x"), "'host:port'"),
    ],
)
def test_bad_arguments_fail_before_connecting(clean_env, kwargs, message):
    with pytest.raises(ValueError, match=message):
        dist.initialize(**kwargs)
    assert not jax.distributed.is_initialized()


def test_mesh_devices_and_ranks_in_one_process():
    assert dist.mesh_devices(8) == jax.devices()[:8]
    assert dist.mesh_devices(3) == jax.devices()[:3]
    with pytest.raises(ValueError, match="only 8 are visible"):
        dist.mesh_devices(9)
    with pytest.raises(ValueError, match="at least one device"):
        dist.mesh_devices(0)
    mesh = jax.make_mesh((4,), ("x",), devices=dist.mesh_devices(4))
    assert dist.process_ranks(mesh) == [0, 1, 2, 3]


def test_bad_heartbeat_or_gloo_interface_fail_before_connecting(clean_env):
    args = dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="heartbeat_timeout_s must be at least 1"):
        dist.initialize(**args, heartbeat_timeout_s=0)
    with pytest.raises(ValueError, match=r"gloo interface 'nope0' \(GLOO_SOCKET_IFNAME\)"):
        dist.initialize(**args, gloo_interface="nope0")
    clean_env.setenv("GLOO_SOCKET_IFNAME", "nope1")
    with pytest.raises(ValueError, match="'nope1'.* is not on this host; it has .*lo"):
        dist.initialize(**args)
    assert not jax.distributed.is_initialized()


def test_lost_process_names_the_peer_of_a_failed_collective(monkeypatch):
    addresses = {0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.2", 3: "10.0.0.3"}
    monkeypatch.setattr(peers, "_addresses", addresses)
    monkeypatch.setattr(peers.distributed.global_state, "process_id", 3)  # this process
    gloo = "UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:547] "
    error = ValueError(gloo + "Connection closed by peer [10.0.0.1]:9388")
    assert dist.lost_process(error) == (
        "process 0 (10.0.0.1) stopped responding: Connection closed by peer [10.0.0.1]:9388"
    )
    error = ValueError(gloo + "Connection closed by peer [10.0.0.2]:9388")
    assert dist.lost_process(error).startswith("one of processes 1, 2 (10.0.0.2) stopped")
    read = "Read error [10.0.0.1]:2: Connection reset by peer (local=[10.0.0.3]:3)"
    assert dist.lost_process(ValueError(gloo + read)).startswith("process 0 (10.0.0.1) stopped")
    error = ValueError(gloo + "Connection closed by peer [10.0.0.9]:1")
    assert dist.lost_process(error).startswith("the process at 10.0.0.9 stopped")
    assert dist.lost_process(ValueError("Gloo all-reduce failed: timeout")) == (
        "a process stopped responding: timeout"
    )
    assert dist.lost_process(ValueError("shapes do not match")) is None
    setup = "Gloo context initialization failed: [pair.cc:152] timed out connecting: "
    assert dist.lost_process(ValueError(setup + "remote=[127.0.0.1]:1")) is None
