"""Train TorchRec's DLRM with jaxrec on synthetic click data.

``DLRM`` (``jaxrec.models``, TorchRec's constructor arguments): a ReLU MLP
embeds the dense features into the 16-dim embedding space, an
``EmbeddingBagCollection`` pools one embedding per sparse feature, the
interaction arch takes all pairwise dot products and the over arch maps them
to a click logit. The data (``synthetic_clicks.py``) plants pairwise feature
interactions, which the dot products can learn. Trained with binary
cross-entropy, Adam for the dense layers and row-wise Adagrad (sparse updates)
for the tables; prints the train/test loss and the test AUC per epoch.

Run from the repository root (about 30 s on two CPU cores)::

    python examples/dlrm.py
"""

import optax
from flax import nnx
from synthetic_clicks import DENSE, parse_args, table_configs, train_ctr_model

from jaxrec import EmbeddingBagCollection
from jaxrec.models import DLRM


def bce(model, batch):
    dense, kjt, labels = batch
    return optax.sigmoid_binary_cross_entropy(model(dense, kjt)[:, 0], labels).mean()


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    ebc = EmbeddingBagCollection(table_configs(embedding_dim=16), rngs=nnx.Rngs(0))
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE,
        dense_arch_layer_sizes=[32, 16],
        over_arch_layer_sizes=[64, 32, 1],
        rngs=nnx.Rngs(1),
    )
    train_ctr_model(model, bce, lambda m, b: m(b[0], b[1])[:, 0], **vars(args))


if __name__ == "__main__":
    main()
