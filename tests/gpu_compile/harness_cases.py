"""Cases that must fail: proof that the harness and the compiler can say no.

A kernel whose tile needs more shared memory than an H100 has, a real kernel
at a tiling that spills 5 KiB, a case that aborts its worker (as an op the
target cannot compile does) and one that hangs (as a pathological tiling kept
``ptxas`` busy for minutes). Each costs well under a second of compiling.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
from compile_runner import Case, compile_abstract
from jax.experimental import pallas as pl

from jaxrec.pallas.triton_backend import pl_triton

ABORT_MESSAGE = "harness_cases.abort: aborting on purpose"


def shared_memory_overflow(*, n):
    """A ``[n, n] @ [n, n]`` float32 matmul; Triton stages both operands in shared memory."""

    def kernel(x_ref, y_ref, o_ref):  # [n, n] float32 each
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    def matmul(x, y):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((n, n), jnp.float32),
            compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1),
        )(x, y)

    x = jax.ShapeDtypeStruct((n, n), jnp.float32)
    return compile_abstract(matmul, x, x)


def abort():
    print(ABORT_MESSAGE, file=sys.stderr, flush=True)
    os.abort()


def hang(*, seconds):
    time.sleep(seconds)


SHARED_MEMORY_OK = Case(
    name="harness-shared-memory-64", target="harness_cases:shared_memory_overflow", kwargs={"n": 64}
)
# 256 x 256 x 4 bytes x 2 operands = 512 KiB; an H100 block gets 227 KiB.
SHARED_MEMORY_OVER = Case(
    name="harness-shared-memory-256",
    target="harness_cases:shared_memory_overflow",
    kwargs={"n": 256},
)
ABORT = Case(name="harness-abort", target="harness_cases:abort")
HANG = Case(name="harness-hang", target="harness_cases:hang", kwargs={"seconds": 600}, timeout_s=2)
SPILLS = Case(  # 32 bags x 256 float32 lanes accumulated by one warp: 256 values a thread
    name="harness-spills-pooled-d256-t32w1",
    target="kernel_cases:pooled",
    kwargs=dict(dtype="float32", dim=256, segments=False, mean=False, block_rows=32, num_warps=1),
)
CASES = (ABORT, HANG, SHARED_MEMORY_OVER, SHARED_MEMORY_OK, SPILLS)
