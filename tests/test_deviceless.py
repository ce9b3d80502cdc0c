"""jaxrec.deviceless: compile-only H100 topologies (GPU compile tests: tests/gpu_compile)."""

import os

import jax
import jax.numpy as jnp
import pytest

from jaxrec import deviceless


def test_target_config_ships_with_the_package():
    text = deviceless.target_config("h100_sxm")
    assert "gpu_device_info" in text and "core_count: 132" in text
    with pytest.raises(ValueError, match="h100_sxm"):
        deviceless.target_config("a100")


def test_unavailable_reason_names_ptxas(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    reason = deviceless.unavailable_reason()
    assert reason is not None and ("ptxas" in reason or "cuda13" in reason)
    if "ptxas" in reason:
        deviceless.topology.cache_clear()
        with pytest.raises(deviceless.UnavailableError, match="ptxas"):
            deviceless.topology("1x1x2")


def test_abstract_arrays_on_an_eight_gpu_mesh_compile():
    reason = deviceless.unavailable_reason()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must compile for GPUs: {reason}")
        pytest.skip(reason)
    topo = deviceless.topology("1x1x8")
    assert len(topo.devices) == 8 and "H100" in topo.devices[0].device_kind
    mesh = deviceless.mesh(topo, ("model",))
    table = deviceless.abstract((80_000_000, 128), jnp.float32, mesh, jax.P("model"))
    out = jax.jit(lambda t: jnp.sum(t, axis=0)).trace(table).lower()
    stats = out.compile(deviceless.COMPILER_OPTIONS).memory_analysis()
    assert stats.argument_size_in_bytes == 80_000_000 * 128 * 4 // 8  # one shard per GPU
    with pytest.raises(ValueError, match="does not hold"):
        deviceless.mesh(topo, ("a", "b"), shape=(3, 3))
