"""``python no_triton_worker.py module|lowering``: jaxrec on a JAX without Pallas's Triton.

Run by test_triton_backend.py in a process of its own, since the removal is
simulated by blocking a module before anything imports it:

* ``module``: ``jax.experimental.pallas.triton`` does not import (JAX removed it);
* ``lowering``: it imports, but ``pallas_call`` cannot lower with Triton
  compiler params (JAX's Triton lowering rule is gone).

Prints ``ok`` when every check passes.
"""

import sys
import warnings

MODE = sys.argv[1]
BLOCKED = {
    "module": "jax.experimental.pallas.triton",
    "lowering": "jax._src.pallas.triton.pallas_call_registration",
}[MODE]
sys.modules[BLOCKED] = None  # importing it now raises ImportError

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jaxrec
    from jaxrec import pallas
    from jaxrec.ops import embedding_bag

    assert not pallas.available()
    reason = pallas.unavailable_reason()
    assert ("does not import" if MODE == "module" else "does not lower") in reason, reason

    tables = [
        jaxrec.EmbeddingBagConfig(
            name="t", embedding_dim=8, num_embeddings=16, feature_names=["f", "g"]
        )
    ]
    kjt = jaxrec.KeyedJaggedTensor(
        ["f", "g"], jnp.array([1, 5, 5, 9, 0, 15, 2]), lengths=jnp.array([2, 0, 1, 3, 1, 0])
    )

    def ebc(impl):
        return jaxrec.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0), implementation=impl)

    expected = np.asarray(ebc("xla")(kjt).values())
    for impl in (None, "pallas"):
        np.testing.assert_allclose(ebc(impl)(kjt).values(), expected, rtol=1e-6, atol=1e-6)

    # A program lowered for CUDA (deviceless) lowers, and holds no Triton kernel.
    w, rows, seg = jnp.ones((16, 8)), jnp.arange(6, dtype=jnp.int32), jnp.arange(6) % 3
    for impl in (None, "pallas"):
        f = jax.jit(lambda w, r, s, impl=impl: embedding_bag(w, r, s, 3, implementation=impl))
        text = f.trace(w, rows, seg).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" not in text, f"{impl=}: a Triton call in the CUDA program"

    try:  # a direct kernel call names the cause
        pallas.pooled_lookup(w, rows, jnp.array([0, 3]), jnp.array([3, 6]), interpret=True)
    except pallas.TritonUnavailableError as e:
        assert isinstance(e, NotImplementedError) and reason in str(e), e
    else:
        raise AssertionError("pooled_lookup ran without Triton")

ours = [w for w in caught if issubclass(w.category, pallas.PallasBackendWarning)]
assert len(ours) == 1, [str(w.message) for w in ours]
message = str(ours[0].message)
assert f"JAX {jax.__version__} cannot lower Pallas to Triton" in message, message
assert "run the XLA path" in message and reason in message, message
print("ok")
