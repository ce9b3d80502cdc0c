"""Train TorchRec's SimpleDeepFMNN (DeepFM) on synthetic clicks.

``SimpleDeepFMNN`` embeds the dense features into the embedding space, then
runs DeepFM's deep interaction (an MLP over all embeddings) and its
factorization machine (second-order interactions) side by side; a sigmoid
over-arch gives the click probability. As in TorchRec the model outputs
probabilities, so the loss is binary cross-entropy on probabilities. Same
data and optimizers as ``examples/dlrm.py``; prints the train/test loss and
test AUC per epoch.

Run from the repository root (about 30 s on two CPU cores)::

    python examples/deepfm.py
"""

import jax.numpy as jnp
from flax import nnx
from synthetic_clicks import DENSE, parse_args, table_configs, train_ctr_model

from jaxrec import EmbeddingBagCollection
from jaxrec.models import SimpleDeepFMNN


def bce_on_probabilities(model, batch):
    dense, kjt, labels = batch
    p = jnp.clip(model(dense, kjt)[:, 0], 1e-7, 1 - 1e-7)
    return -jnp.mean(labels * jnp.log(p) + (1 - labels) * jnp.log1p(-p))


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    ebc = EmbeddingBagCollection(table_configs(embedding_dim=16), rngs=nnx.Rngs(0))
    model = SimpleDeepFMNN(
        num_dense_features=DENSE,
        embedding_bag_collection=ebc,
        hidden_layer_size=32,
        deep_fm_dimension=16,
        rngs=nnx.Rngs(1),
    )
    train_ctr_model(model, bce_on_probabilities, lambda m, b: m(b[0], b[1])[:, 0], **vars(args))


if __name__ == "__main__":
    main()
