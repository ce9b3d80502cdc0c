"""Inference: row-wise quantized tables and collections, sharded inference, export."""

from ..xla.quantize import dequantize_rows as dequantize_rows
from ..xla.quantize import quantize_rows as quantize_rows
from ..xla.quantize import row_bytes as row_bytes
from .artifact import ArtifactError as ArtifactError
from .artifact import ExportedModel as ExportedModel
from .artifact import InputError as InputError
from .artifact import UnverifiedArtifactWarning as UnverifiedArtifactWarning
from .artifact import load as load
from .export import export as export
from .quant_modules import QuantEmbeddingBagCollection as QuantEmbeddingBagCollection
from .quant_modules import QuantEmbeddingCollection as QuantEmbeddingCollection
from .quant_modules import quantize_inference_model as quantize_inference_model
from .quant_ops import quant_embedding_bag as quant_embedding_bag
from .serving import PredictionServer as PredictionServer
from .serving import predict_file as predict_file
from .sharded import ShardedQuantEmbeddingBagCollection as ShardedQuantEmbeddingBagCollection
from .sharded import ShardedQuantEmbeddingCollection as ShardedQuantEmbeddingCollection
from .sharded import shard_quant_model as shard_quant_model
