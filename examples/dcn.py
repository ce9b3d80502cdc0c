"""Train TorchRec's DLRM_DCN (DLRM with a DCN-v2 cross network) on synthetic clicks.

``DLRM_DCN`` replaces DLRM's pairwise dot products with a low-rank cross
network (``LowRankCrossNet``: ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``)
over the concatenated dense and sparse embeddings, ``[B, (F + 1) * D]``. Same
data, loss and optimizers as ``examples/dlrm.py``; prints the train/test loss
and test AUC per epoch.

Run from the repository root (about 40 s on two CPU cores)::

    python examples/dcn.py
"""

import optax
from flax import nnx
from synthetic_clicks import DENSE, parse_args, table_configs, train_ctr_model

from jaxrec import EmbeddingBagCollection
from jaxrec.models import DLRM_DCN


def bce(model, batch):
    dense, kjt, labels = batch
    return optax.sigmoid_binary_cross_entropy(model(dense, kjt)[:, 0], labels).mean()


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    ebc = EmbeddingBagCollection(table_configs(embedding_dim=16), rngs=nnx.Rngs(0))
    model = DLRM_DCN(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE,
        dense_arch_layer_sizes=[32, 16],
        over_arch_layer_sizes=[64, 32, 1],
        dcn_num_layers=2,
        dcn_low_rank_dim=16,
        rngs=nnx.Rngs(1),
    )
    train_ctr_model(model, bce, lambda m, b: m(b[0], b[1])[:, 0], **vars(args))


if __name__ == "__main__":
    main()
