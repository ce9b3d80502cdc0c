"""The TorchRec state_dict converter: key mapping, errors, dtypes, export round trip."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from torchrec_helpers import jit_call, needs_torchrec, run_torch, to_torch

import jaxrec as jr
import jaxrec.modules as jm
from jaxrec.modules.initializers import torch_linear


class Model(nnx.Module):
    """An EBC, an MLP and a Sequential with a bare nnx.Linear (keys as TorchRec names them)."""

    def __init__(self, *, rngs):
        tables = [jr.EmbeddingBagConfig(name="t", embedding_dim=3, num_embeddings=5)]
        self.ebc = jr.EmbeddingBagCollection(tables, rngs=rngs)
        self.mlp = jm.MLP(3, [4], rngs=rngs)
        self.head = nnx.Sequential(torch_linear(4, 2, rngs=rngs), nnx.relu)


KEYS = {
    "ebc.embedding_bags.t.weight": (5, 3),
    "mlp._mlp.0._linear.weight": (4, 3),
    "mlp._mlp.0._linear.bias": (4,),
    "head.0.weight": (2, 4),
    "head.0.bias": (2,),
}


def numpy_state(seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in KEYS.items()}


def test_keys_shapes_and_transposed_linear_weights():
    model = nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(0)))
    assert jm.torchrec_keys(model) == KEYS
    sd = numpy_state()
    jm.load_torchrec_state_dict(model, sd)
    np.testing.assert_array_equal(model.head.layers[0].kernel.get_value(), sd["head.0.weight"].T)
    np.testing.assert_array_equal(
        model.ebc.state_dict()["embedding_bags.t.weight"], sd["ebc.embedding_bags.t.weight"]
    )
    exported = jm.torchrec_state_dict(model)
    assert exported.keys() == sd.keys()
    for k in sd:
        np.testing.assert_array_equal(exported[k], sd[k])


def test_errors_list_unknown_missing_and_mismatched_keys():
    model = nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(0)))
    sd = numpy_state()
    sd.pop("head.0.bias")
    sd["head.1.weight"] = np.zeros((2, 2), np.float32)
    sd["mlp._mlp.0._linear.weight"] = np.zeros((3, 4), np.float32)  # not transposed
    with pytest.raises(ValueError) as err:
        jm.load_torchrec_state_dict(model, sd)
    msg = str(err.value)
    assert "unknown keys (not in the model): ['head.1.weight']" in msg
    assert "missing keys (model tensors not given): ['head.0.bias']" in msg
    assert "mlp._mlp.0._linear.weight: model (4, 3), state_dict (3, 4)" in msg


def test_non_strict_loads_what_matches():
    model = Model(rngs=nnx.Rngs(0))
    bias = np.asarray(model.head.layers[0].bias.get_value()).copy()
    sd = {"head.0.weight": np.ones((2, 4), np.float32), "other.weight": np.ones(3, np.float32)}
    jm.load_torchrec_state_dict(model, sd, strict=False)
    np.testing.assert_array_equal(model.head.layers[0].kernel.get_value(), np.ones((4, 2)))
    np.testing.assert_array_equal(model.head.layers[0].bias.get_value(), bias)


def test_torch_tensors_of_any_float_dtype_and_export_into_torchrec():
    torch, _ = needs_torchrec()
    from torchrec.modules.mlp import MLP

    ours = jm.MLP(3, [4, 2], param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    sd = {k: to_torch(v).to(torch.bfloat16) for k, v in numpy_state().items() if "mlp" in k}
    sd = {k.removeprefix("mlp."): v for k, v in sd.items()}
    sd["_mlp.1._linear.weight"] = torch.ones(2, 4, dtype=torch.float16)
    sd["_mlp.1._linear.bias"] = torch.zeros(2)
    jm.load_torchrec_state_dict(ours, sd)
    assert ours._mlp.layers[1]._linear.kernel.get_value().dtype == jnp.bfloat16

    theirs = MLP(3, [4, 2])  # export: a float32 jaxrec MLP into TorchRec
    ours32 = jm.MLP(3, [4, 2], rngs=nnx.Rngs(1))
    theirs.load_state_dict({k: to_torch(v) for k, v in jm.torchrec_state_dict(ours32).items()})
    x = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(jit_call(ours32, x), run_torch(theirs, to_torch(x)), rtol=1e-5)
