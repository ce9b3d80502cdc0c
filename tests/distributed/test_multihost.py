"""jaxrec.distributed's multi-process entry points, in one process (no runtime is started).

The two-process run itself is tested through the job (tests/jobs/test_multihost_job.py)
and the sharded collections (test_multiprocess.py).
"""

import jax
import pytest

from jaxrec import distributed as dist

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
