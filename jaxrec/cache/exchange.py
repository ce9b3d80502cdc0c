"""Bytes from every process, for the cache's replicated planning.

Through the coordination service's key-value store (``jax.distributed``), not a device
collective: a pipeline prepares batches on its own thread while steps run, and a device
collective issued there could be ordered differently on each process than the step's
own collectives, and hang.
"""

from __future__ import annotations

import jax
from jax._src import distributed  # the client of jax.distributed.initialize


def allgather(tag: str, round_: int, payload: bytes, timeout_s: float) -> list[bytes]:
    """Every process's ``payload`` for exchange ``round_`` of ``tag``, in process order.
    Each process must call it with the same ``tag`` and rounds, in the same order."""
    n, me = jax.process_count(), jax.process_index()
    if n == 1:
        return [payload]
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("several processes but no jax.distributed client: call "
                           "jax.distributed.initialize first")  # fmt: skip
    client.key_value_set_bytes(f"{tag}/{round_}/{me}", payload)
    out = []
    for q in range(n):
        if q == me:
            out.append(payload)
            continue
        try:
            out.append(client.blocking_key_value_get_bytes(f"{tag}/{round_}/{q}",
                                                           int(timeout_s * 1000)))  # fmt: skip
        except Exception as e:  # noqa: BLE001  (XlaRuntimeError: deadline exceeded)
            raise TimeoutError(
                f"process {q} sent nothing for {tag} round {round_} within {timeout_s} s: "
                f"did it stop, or prepare other batches than this process? ({e})"
            ) from None
    if round_ >= 2:  # every process has read round - 2: it sent round - 1 after
        client.key_value_delete(f"{tag}/{round_ - 2}/{me}")
    return out
