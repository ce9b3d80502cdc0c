"""Ragged sparse features as pytrees with static capacities."""

from .capacity import MonotoneCapacities as MonotoneCapacities
from .capacity import bucket_capacity as bucket_capacity
from .jagged_tensor import JaggedTensor as JaggedTensor
from .keyed_jagged_tensor import KeyedJaggedTensor as KeyedJaggedTensor
from .keyed_tensor import KeyedTensor as KeyedTensor
