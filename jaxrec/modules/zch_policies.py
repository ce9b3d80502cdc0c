"""Eviction and admission policies of dynamic (hash zero-collision) tables.

Static configuration, as frozen dataclasses: the index program reads them at
trace time. Names follow TorchRec's ``HashZchManagedCollisionModule``
(``HashZchEvictionPolicyName``, ``HashZchEvictionConfig``) and NVIDIA
dynamicemb's admission strategies.

Time is counted in **training calls** of the module (its ``current_iter``), not
hours: a TTL of 24 means "evictable 24 training calls after the last use".
"""

from __future__ import annotations

import dataclasses
import enum


class HashZchEvictionPolicyName(enum.Enum):
    """Which slot of a full bucket a new id takes.

    * ``LRU_EVICTION``: the least recently used (oldest last use, then the lowest way).
    * ``LFU_EVICTION``: the least frequently used (fewest uses, then oldest, then way).
    * ``SINGLE_TTL_EVICTION``: only entries unused for more than ``single_ttl``
      calls may be evicted (oldest first); a bucket of live entries rejects new ids.
    """

    LRU_EVICTION = "LRU_EVICTION"
    LFU_EVICTION = "LFU_EVICTION"
    SINGLE_TTL_EVICTION = "SINGLE_TTL_EVICTION"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HashZchEvictionConfig:
    """The eviction policy and its parameter.

    Args:
        policy: see :class:`HashZchEvictionPolicyName`.
        single_ttl: calls an entry lives after its last use
            (``SINGLE_TTL_EVICTION`` only, >= 1).
    """

    policy: HashZchEvictionPolicyName = HashZchEvictionPolicyName.LRU_EVICTION
    single_ttl: int | None = None

    def __post_init__(self):
        if not isinstance(self.policy, HashZchEvictionPolicyName):
            raise TypeError(f"policy must be a HashZchEvictionPolicyName, got {self.policy!r}")
        ttl = self.policy is HashZchEvictionPolicyName.SINGLE_TTL_EVICTION
        if ttl and not (isinstance(self.single_ttl, int) and self.single_ttl >= 1):
            raise ValueError(f"SINGLE_TTL_EVICTION needs single_ttl >= 1, got {self.single_ttl!r}")
        if not ttl and self.single_ttl is not None:
            raise ValueError(f"single_ttl applies to SINGLE_TTL_EVICTION only, not {self.policy}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrequencyAdmission:
    """An id gets a slot once it has been seen ``threshold`` times (dynamicemb's
    ``FrequencyAdmissionStrategy``).

    Counts of ids without a slot are kept in a count-min sketch of fixed size:
    ``ways`` int32 cells per bucket (4 bytes a slot), two cells per id, the
    estimate their minimum. An estimate can only exceed the true count (two ids
    sharing both cells), so an id is never admitted later than its
    ``threshold``-th sighting; it may be admitted earlier. Counts never decay.

    Args:
        threshold: sightings (in training calls, each occurrence counts) before
            admission, >= 1 (1 admits on first sight, like no admission policy).
    """

    threshold: int

    def __post_init__(self):
        if not (isinstance(self.threshold, int) and self.threshold >= 1):
            raise ValueError(f"threshold must be an int >= 1, got {self.threshold!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbabilityAdmission:
    """Each id is admitted with probability ``probability``, decided once per id from
    its hash (TorchRec's ``opt_in_prob``): an id that is not admitted never is.

    Args:
        probability: in ``(0, 1]``.
    """

    probability: float

    def __post_init__(self):
        p = self.probability
        if not (isinstance(p, float | int) and 0 < p <= 1):
            raise ValueError(f"probability must be in (0, 1], got {p!r}")

    def cutoff(self) -> int:
        """Ids whose hash's low word is below this are admitted (``2**32`` admits all)."""
        return min(int(self.probability * 2**32), 2**32)


Admission = FrequencyAdmission | ProbabilityAdmission | None
