"""No CUDA-plugin traceback on a machine without an NVIDIA GPU (jaxrec.gpu_presence)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from jaxrec.gpu_presence import SKIP_CHECK, has_nvidia_device, skip_cuda_checks_without_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sets_the_plugin_switch_only_without_a_device(tmp_path):
    device = tmp_path / "nvidia0"
    environ: dict[str, str] = {}
    assert skip_cuda_checks_without_gpu(environ, files=(str(device),))
    assert environ == {SKIP_CHECK: "1"}
    device.touch()  # a GPU machine: a real CUDA setup error must still show
    environ = {}
    assert not skip_cuda_checks_without_gpu(environ, files=(str(device),))
    assert environ == {}


def test_a_value_the_user_set_is_kept(tmp_path):
    environ = {SKIP_CHECK: ""}
    assert not skip_cuda_checks_without_gpu(environ, files=(str(tmp_path / "none"),))
    assert environ == {SKIP_CHECK: ""}


@pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins.xla_cuda13") is None or has_nvidia_device(),
    reason="needs the CUDA plugin installed (gpu-compile extra) and no NVIDIA device",
)
@pytest.mark.parametrize("first", ["import jax; import jaxrec", "import jaxrec; import jax"])
def test_jax_starts_quietly_after_import_jaxrec(first):
    # JAX_PLATFORMS unset (tests set it to cpu): the case of a user's own script.
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", SKIP_CHECK)}
    env["PYTHONPATH"] = ROOT
    code = f"{first}; print(jax.devices()[0].platform)"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cpu"
    assert result.stderr == "", result.stderr
