"""A dynamic table's index step compiled deviceless for an H100: the XLA program a GPU
runs (``jaxrec.modules.zch_index.train_step``; the C++ kernel is for CPU lowerings only),
with abstract inputs. A 10M-slot index (16 ways, 160 MB of state) and a batch of
8192 x 20 ids, LRU and LFU with frequency admission; state donated, as a train step runs
it. Each returns ``(compiled, facts)``: the sizes the test's bounds are written in.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from compile_runner import Case

from jaxrec import deviceless
from jaxrec.modules import zch_index as zi
from jaxrec.modules.zch_policies import (
    FrequencyAdmission,
    HashZchEvictionConfig,
    HashZchEvictionPolicyName,
)

SLOTS, WAYS, IDS = 10_000_000, 16, 8192 * 20


def index_step(*, policy="lru", admission=0):
    eviction = HashZchEvictionConfig(policy=HashZchEvictionPolicyName[f"{policy.upper()}_EVICTION"])
    layout = zi.ZchLayout(
        slots=SLOTS,
        ways=WAYS,
        total_buckets=SLOTS // WAYS,
        eviction=eviction,
        admission=FrequencyAdmission(threshold=admission) if admission else None,
    )
    mesh = deviceless.mesh(deviceless.topology("1x1x1"))
    state = deviceless.abstract_like(jax.eval_shape(lambda: zi.empty_state(layout)), mesh)
    words = [deviceless.abstract((IDS,), jnp.uint32, mesh) for _ in range(2)]
    valid = deviceless.abstract((IDS,), jnp.bool_, mesh)
    t0 = time.perf_counter()
    step = functools.partial(zi.train_step, layout, max_evictions=IDS)
    compiled = (
        jax.jit(step, donate_argnums=0)
        .trace(state, *words, valid)
        .lower()
        .compile(compiler_options=deviceless.COMPILER_OPTIONS)
    )
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    facts = {
        "compile_s": round(time.perf_counter() - t0, 2),
        "state_bytes": state_bytes,
        "ids": IDS,
        "ways": WAYS,
    }
    return compiled, facts


CASES = [
    Case(name="index_lru", target="zch_cases:index_step", kwargs={"policy": "lru"}),
    Case(
        name="index_lfu_admission",
        target="zch_cases:index_step",
        kwargs={"policy": "lfu", "admission": 2},
    ),
]
