"""Quiet JAX starts on machines without an NVIDIA GPU, with the CUDA plugin installed.

The ``gpu-compile`` extra installs JAX's CUDA plugin (``jaxrec.deviceless``
compiles for H100s with it, on a CPU). At its first backend start JAX calls
every plugin's ``initialize()``, and the CUDA plugin's checks the CUDA
libraries' versions before it registers; without cuDNN that raises, and JAX
logs the error with a 20-line traceback on every start, although it then skips
the CUDA backend anyway on a machine with no NVIDIA device
(``jax._src.hardware_utils.has_visible_nvidia_gpu``).

:func:`skip_cuda_checks_without_gpu` (run by ``import jaxrec``) sets the
plugin's own switch, ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``, only where JAX
would skip the CUDA backend: no ``/dev/nvidia0``, ``/dev/nvidiactl`` or
``/dev/dxg``. The plugin then registers as it does under
``JAX_PLATFORMS=cpu`` (its compile-only topologies work) and nothing is
printed. On a machine with an NVIDIA device nothing changes, so a real CUDA
setup error is still shown. It must run before JAX's backend starts (the first
``jax.devices()`` or array), not before ``import jax``.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# The device files JAX itself looks for before it starts the CUDA backend.
NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


def has_nvidia_device(files: tuple[str, ...] = NVIDIA_DEVICE_FILES) -> bool:
    """Whether an NVIDIA device file is present (JAX's own test)."""
    return any(os.path.exists(f) for f in files)


def skip_cuda_checks_without_gpu(
    environ: MutableMapping[str, str] = os.environ,
    files: tuple[str, ...] = NVIDIA_DEVICE_FILES,
) -> bool:
    """Sets ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` in ``environ`` when no NVIDIA device
    is present and the variable is unset; returns whether it did."""
    if SKIP_CHECK in environ or has_nvidia_device(files):
        return False
    environ[SKIP_CHECK] = "1"
    return True
