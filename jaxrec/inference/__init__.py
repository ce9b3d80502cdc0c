"""Inference: row-wise quantized tables and collections, sharded inference, export."""

from .quant_modules import QuantEmbeddingBagCollection as QuantEmbeddingBagCollection
from .quant_modules import QuantEmbeddingCollection as QuantEmbeddingCollection
from .quant_modules import quantize_inference_model as quantize_inference_model
from .quant_ops import quant_embedding_bag as quant_embedding_bag
from .quantize import dequantize_rows as dequantize_rows
from .quantize import quantize_rows as quantize_rows
from .quantize import row_bytes as row_bytes
from .sharded import ShardedQuantEmbeddingBagCollection as ShardedQuantEmbeddingBagCollection
from .sharded import ShardedQuantEmbeddingCollection as ShardedQuantEmbeddingCollection
from .sharded import shard_quant_model as shard_quant_model
