"""Checkpoints in the logical layout: save under one sharding plan, restore under any other."""

from .delta import Link as Link
from .delta import ModelDeltaTracker as ModelDeltaTracker
from .delta import Published as Published
from .delta import Restored as Restored
from .layout import HostRows as HostRows
from .logical import LogicalState as LogicalState
from .logical import logical_state as logical_state
from .logical import place_state as place_state
from .manager import CheckpointManager as CheckpointManager
from .manager import CheckpointWarning as CheckpointWarning
from .spec import state_spec as state_spec
from .store import CheckpointCorruptError as CheckpointCorruptError
