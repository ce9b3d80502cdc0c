"""Ragged sparse features as pytrees with static capacities."""

from .capacity import MonotoneCapacities as MonotoneCapacities
from .capacity import bucket_capacity as bucket_capacity
from .ids64 import from_id_words as from_id_words
from .ids64 import hash64_np as hash64_np
from .ids64 import hash64_words as hash64_words
from .ids64 import id_words as id_words
from .ids64 import is_wide as is_wide
from .ids64 import narrow_ids as narrow_ids
from .ids64 import to_id_words as to_id_words
from .jagged_tensor import JaggedTensor as JaggedTensor
from .keyed_jagged_tensor import KeyedJaggedTensor as KeyedJaggedTensor
from .keyed_tensor import KeyedTensor as KeyedTensor
from .vbe import dedup_features as dedup_features
from .vbe import expand_vbe as expand_vbe
from .vbe import pad_strides as pad_strides
