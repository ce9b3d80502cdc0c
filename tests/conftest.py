"""Test setup: 8 fake CPU devices for sharding tests, set before JAX starts."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Without a GPU, the CUDA plugin (installed for tests/gpu_compile) would log a
# failed initialisation at every JAX start; with JAX_PLATFORMS=cpu it only
# registers its compile-only topologies. Subprocesses inherit the setting.
_GPUS = "/proc/driver/nvidia/gpus"
if not (os.path.isdir(_GPUS) and os.listdir(_GPUS)):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
