"""Pure lookup functions; ``implementation=`` selects the kernels (XLA, Pallas or C++)."""

from ..xla.bounds import BoundsCheckMode as BoundsCheckMode
from ..xla.bounds import check_ids as check_ids
from ..xla.slots import FeatureSlot as FeatureSlot
from .dispatch import IMPLEMENTATIONS as IMPLEMENTATIONS
from .dispatch import Implementation as Implementation
from .grouped import grouped_pooled_lookup as grouped_pooled_lookup
from .grouped import grouped_sequence_lookup as grouped_sequence_lookup
from .pooled import embedding_bag as embedding_bag
from .pooled import embedding_gather as embedding_gather
from .single import pooled_lookup as pooled_lookup
from .single import sequence_lookup as sequence_lookup
from .vbe import expand_slots as expand_slots
