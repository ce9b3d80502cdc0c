"""EmbeddingTower / EmbeddingTowerCollection: TorchRec parity and input routing."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from torchrec_helpers import (
    assert_close,
    jax_kjt,
    jit_call,
    needs_torchrec,
    numpy_weights,
    random_kjt_arrays,
    randomize,
    torch_kjt,
    torch_tables,
)

import jaxrec as jr
import jaxrec.modules as jm
from jaxrec.modules.initializers import torch_linear

T1 = jr.EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=12, feature_names=["a"])
T2 = jr.EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=8, feature_names=["b"])


class Interaction(nnx.Module):
    """Linear over the pooled embeddings (parameters at ``interaction.linear.*``)."""

    def __init__(self, width, out, *, rngs):
        self.linear = torch_linear(width, out, rngs=rngs)

    def __call__(self, kt):
        return self.linear(kt.values())


def build_towers():
    rngs = nnx.Rngs(0)
    plain = jm.EmbeddingTower(
        jr.EmbeddingBagCollection([T1], rngs=rngs), Interaction(4, 2, rngs=rngs)
    )
    weighted = jm.EmbeddingTower(
        jr.EmbeddingBagCollection([T2], is_weighted=True, rngs=rngs), Interaction(3, 5, rngs=rngs)
    )
    return jm.EmbeddingTowerCollection([plain, weighted])


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    va, la = random_kjt_arrays(rng, ["a"], {"a": 12}, batch=4)
    vb, lb = random_kjt_arrays(rng, ["b"], {"b": 8}, batch=4)
    wb = rng.uniform(0.5, 2.0, len(vb)).astype(np.float32)
    return (va, la), (vb, lb, wb)


def test_tower_collection_matches_torchrec():
    torch, torchrec = needs_torchrec()
    from torchrec.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection

    class TorchInteraction(torch.nn.Module):
        def __init__(self, width, out):
            super().__init__()
            self.linear = torch.nn.Linear(width, out)

        def forward(self, kt):
            return self.linear(kt.values())

    theirs = EmbeddingTowerCollection(
        [
            EmbeddingTower(
                torchrec.EmbeddingBagCollection(tables=torch_tables([T1])), TorchInteraction(4, 2)
            ),
            EmbeddingTower(
                torchrec.EmbeddingBagCollection(tables=torch_tables([T2]), is_weighted=True),
                TorchInteraction(3, 5),
            ),
        ]
    )
    randomize(theirs)
    ours = nnx.eval_shape(build_towers)
    assert sorted(jm.torchrec_keys(ours)) == sorted(theirs.state_dict())  # towers.<i>.*
    jm.load_torchrec_state_dict(ours, theirs.state_dict())
    (va, la), (vb, lb, wb) = inputs()
    got = jit_call(ours, jax_kjt(["a"], va, la), jax_kjt(["b"], vb, lb, wb))
    with torch.no_grad():
        want = theirs(torch_kjt(["a"], va, la), torch_kjt(["b"], vb, lb, wb))
    assert got.shape == (4, 7)
    assert_close(got, want.numpy())


def test_tower_routing_and_errors():
    ec = numpy_weights(
        lambda: jr.EmbeddingCollection(
            [jr.EmbeddingConfig(name="s", embedding_dim=2, num_embeddings=12, feature_names=["a"])],
            rngs=nnx.Rngs(0),
        )
    )
    assert jm.embedding_tower.tower_input_params(ec) == (True, False)
    towers = nnx.eval_shape(build_towers)
    assert towers._input_params == ((True, False), (False, True))
    (va, la), _ = inputs()
    with pytest.raises(ValueError, match=r"tower 1 \(EmbeddingBagCollection\) needs"):
        towers(features=jax_kjt(["a"], va, la))
    seq = jm.EmbeddingTower(ec, lambda jts: jnp.stack([jt.lengths() for jt in jts.values()], 1))
    out = jit_call(jm.EmbeddingTowerCollection([seq]), features=jax_kjt(["a"], va, la))
    np.testing.assert_array_equal(out[:, 0], la)
    with pytest.raises(TypeError, match="must be an EmbeddingTower"):
        jm.EmbeddingTowerCollection([ec])
