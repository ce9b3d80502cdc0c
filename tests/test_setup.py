import jax


def test_eight_fake_cpu_devices_for_sharding_tests():
    # tests/conftest.py must configure them before JAX starts.
    assert jax.device_count() == 8
    assert {d.platform for d in jax.devices()} == {"cpu"}
