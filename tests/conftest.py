"""Test setup: 8 fake CPU devices for sharding tests, set before JAX starts."""

import os

# LLVM's backend optimisation off: the suite is dominated by compiling many small
# programs (a sharded EBC test file took 28% less CPU time); HLO passes, and so the
# programs' numerics and buffers, are unchanged. Subprocess tests set their own flags.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
# Without a GPU, the CUDA plugin (installed for tests/gpu_compile) would log a
# failed initialisation at every JAX start; with JAX_PLATFORMS=cpu it only
# registers its compile-only topologies. Subprocesses inherit the setting.
_GPUS = "/proc/driver/nvidia/gpus"
if not (os.path.isdir(_GPUS) and os.listdir(_GPUS)):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
