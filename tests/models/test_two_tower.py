"""TwoTower against a TorchRec two-tower (the retrieval example's), losses, retrieval, training."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_inputs import B, abstract, arrays, check_train_step, jax_batch
from torchrec_helpers import (
    assert_close,
    needs_torchrec,
    numpy_weights,
    randomize,
    torch_kjt,
    torch_tables,
)

import jaxrec as jr
from jaxrec import models

KEYS = ["user", "item"]
ROWS = {"user": 30, "item": 25}
TABLES = [
    jr.EmbeddingBagConfig(
        name="user_t", embedding_dim=4, num_embeddings=30, feature_names=["user"]
    ),
    jr.EmbeddingBagConfig(
        name="item_t", embedding_dim=4, num_embeddings=25, feature_names=["item"]
    ),
]


def build():
    ebc = jr.EmbeddingBagCollection(TABLES, rngs=nnx.Rngs(0))
    return models.TwoTower(ebc, layer_sizes=[6, 3], rngs=nnx.Rngs(1))


def torch_two_tower():
    """TorchRec's retrieval-example TwoTower, restated (that module imports faiss)."""
    torch, torchrec = needs_torchrec()
    from torchrec.modules.mlp import MLP

    class TwoTower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = torchrec.EmbeddingBagCollection(tables=torch_tables(TABLES))
            self.query_proj = MLP(in_size=4, layer_sizes=[6, 3])
            self.candidate_proj = MLP(in_size=4, layer_sizes=[6, 3])

        def forward(self, kjt):
            pooled = self.ebc(kjt)
            return self.query_proj(pooled["user"]), self.candidate_proj(pooled["item"])

    return randomize(TwoTower())


def test_two_tower_and_bce_task_match_torchrec():
    torch, _ = needs_torchrec()
    theirs = torch_two_tower()
    ours = abstract(build)
    assert sorted(models.torchrec_keys(ours)) == sorted(theirs.state_dict())
    models.load_torchrec_state_dict(ours, theirs.state_dict())
    _, values, lengths, labels = arrays(seed=5, keys=KEYS, rows=ROWS)
    task = models.TwoTowerTrainTask(ours)
    kjt = jr.KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths)
    (q, c), (loss, (_, logits, _)) = nnx.jit(lambda m, k, y: (m.two_tower(k), m(k, y)))(
        task, kjt, jnp.asarray(labels)
    )
    with torch.no_grad():
        tq, tc = theirs(torch_kjt(KEYS, values, lengths))
        t_logits = (tq * tc).sum(dim=1)
        t_loss = torch.nn.BCEWithLogitsLoss()(t_logits, torch.from_numpy(labels))
    assert q.shape == c.shape == (B, 3)
    assert_close(q, tq.numpy())
    assert_close(c, tc.numpy())
    assert_close(logits, t_logits.numpy())
    assert_close(loss, t_loss.numpy())


def test_in_batch_softmax_loss_matches_numpy():
    rng = np.random.default_rng(0)
    q, c = rng.normal(size=(2, 5, 3)).astype(np.float32)
    log_q = np.log(rng.uniform(0.1, 1, 5)).astype(np.float32)
    logits = q @ c.T / 0.5 - log_q[None, :]
    want = np.mean(np.log(np.exp(logits).sum(1)) - np.diag(logits))
    got = models.in_batch_softmax_loss(jnp.asarray(q), jnp.asarray(c), 0.5, jnp.asarray(log_q))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    with pytest.raises(ValueError, match=r"both be \[B, W\]"):
        models.in_batch_softmax_loss(jnp.ones((2, 3)), jnp.ones((3, 3)))


def test_top_k_candidates():
    cands = jnp.asarray(np.eye(4, 2, dtype=np.float32) * [1.0, 2.0])  # ids 0, 1 score
    scores, ids = models.top_k_candidates(jnp.asarray([[1.0, 1.0]]), cands, 2)
    np.testing.assert_array_equal(ids, [[1, 0]])
    np.testing.assert_allclose(scores, [[2.0, 1.0]])
    with pytest.raises(ValueError, match="k must be in"):
        models.top_k_candidates(jnp.ones((1, 2)), cands, 5)


def test_two_tower_train_step_with_in_batch_softmax():
    def loss_fn(model, batch):
        _, kjt, _ = batch
        return models.in_batch_softmax_loss(*model(kjt), temperature=0.2)

    batches = [jax_batch(s, keys=KEYS, rows=ROWS) for s in (1, 2)]
    check_train_step(numpy_weights(build), loss_fn, batches)


def test_two_tower_needs_two_tables_of_one_dim():
    with pytest.raises(ValueError, match="expects two tables"):
        nnx.eval_shape(
            lambda: models.TwoTower(
                jr.EmbeddingBagCollection(TABLES[:1], rngs=nnx.Rngs(0)), [2], rngs=nnx.Rngs(0)
            )
        )
