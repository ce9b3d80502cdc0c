"""Which kernel serves each op on each backend: two plain tables.

``jaxrec.ops.dispatch`` looks ops up here; an op missing from a table runs its
XLA function on that backend. Importing the kernels' Python wrappers is cheap:
the C++ extension loads the first time a CPU kernel may run
(``jaxrec.cpu.loader``), and Pallas kernels compile only when traced.
"""

from __future__ import annotations

from collections.abc import Callable

from ..cpu.init import uniform_rows_cpu
from ..cpu.kernels import (
    backward_update_cpu,
    embedding_bag_cpu,
    grouped_pooled_lookup_cpu,
    kjt_backward_update_cpu,
)
from ..pallas.adapters import (
    embedding_bag_pallas,
    embedding_gather_pallas,
    fused_backward_update_pallas,
    sparse_update_pallas,
)
from ..pallas.quant_lookup import quant_embedding_bag_pallas

# op -> ``fn(*xla_args, interpret=bool, **xla_kwargs)``: interpret is False in
# the branch staged for GPUs, True elsewhere (the Pallas interpreter).
PALLAS: dict[str, Callable] = {
    "embedding_bag": embedding_bag_pallas,
    "embedding_gather": embedding_gather_pallas,
    "sparse_update": sparse_update_pallas,
    "fused_backward_update": fused_backward_update_pallas,
    "quant_embedding_bag": quant_embedding_bag_pallas,
}


def _embedding_bag_mosaic(*args, **kwargs):
    # Imported on first use: Mosaic GPU stays out of ``import jaxrec``.
    from ..pallas.mosaic_pooled import embedding_bag_mosaic

    return embedding_bag_mosaic(*args, **kwargs)


# op -> ``fn(*xla_args, interpret=bool, **xla_kwargs)`` for ``implementation=
# "mosaic_gpu"`` (Pallas's Mosaic GPU backend, sm_90+): the first kernels moved
# off Triton, not yet timed on a GPU (docs/guides/kernels.md).
MOSAIC_GPU: dict[str, Callable] = {"embedding_bag": _embedding_bag_mosaic}

# ``implementation=None`` in a program for a GPU runs an op's Pallas kernel only
# where it was measured faster than XLA on a GPU, or never measured slower;
# each entry says which. An op left out runs XLA there (``"pallas"`` still
# forces its kernel). A GPU run that finds a kernel slower on any preset
# (bench/gpu_check.sh, bench/gpu_lookup.py) removes it here; the figures are in
# docs/guides/kernels.md.
GPU_DEFAULT_PALLAS: dict[str, str] = {
    "embedding_bag": "faster than XLA on every gpu_lookup preset (H200, 2026-11-26)",
    "embedding_gather": "faster than XLA at the target preset (H200, 2026-11-26)",
    "fused_backward_update": (
        "3.0x faster than XLA on uniform ids (H200, 2026-11-26); the one-program-per-run "
        "schedule that lost on Zipf ids was replaced by the load-balanced one, whose "
        "update launch is the measured one (not yet timed on a GPU with skewed ids)"
    ),
    "sparse_update": "not timed on a GPU alone; the fused backward's update launch",
    "quant_embedding_bag": "not timed on a GPU",
}

# op -> ``fn(*args, **kwargs)``, the op's arguments (``try_cpu`` ops have no
# XLA twin of the same signature: their fallback is a closure).
CPU: dict[str, Callable] = {
    "embedding_bag": embedding_bag_cpu,
    "grouped_pooled_lookup": grouped_pooled_lookup_cpu,
    "fused_backward_update": backward_update_cpu,
    "kjt_backward_update": kjt_backward_update_cpu,
    "uniform_rows": uniform_rows_cpu,
}
