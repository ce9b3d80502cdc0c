"""What a Mosaic GPU kernel will ask of the GPU, read from a lowered program without one.

Deviceless, XLA compiles the program around a Mosaic GPU kernel but not the
kernel: the ``mosaic_gpu_v2`` custom call carries the kernel as serialized
MLIR, which jaxlib's Mosaic GPU runtime turns into PTX and a cubin (``ptxas``)
only when the program is loaded on a GPU. What is settled at lowering is the
launch: the ``gpu.launch`` op fixes the grid, the block and the dynamic shared
memory. This module reads them, so CI checks what the driver would otherwise
reject at launch time (shared memory over the SM's 227 KiB, a grid ``y``/``z``
over 65,535).
"""

from __future__ import annotations

import dataclasses

from jaxlib.mlir import ir, passmanager

SMEM_LIMIT = 227 * 1024  # dynamic shared memory one Hopper CTA may use
GRID_YZ_LIMIT = 65_535  # CUDA's limit on gridDim.y and gridDim.z (x: 2^31 - 1)


@dataclasses.dataclass(frozen=True)
class Launch:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int

    def check(self) -> None:
        """Raises ``AssertionError`` when a GPU would refuse the launch."""
        if self.smem_bytes > SMEM_LIMIT:
            raise AssertionError(f"{self} asks for more than {SMEM_LIMIT} bytes of shared memory")
        if max(self.grid[1:]) > GRID_YZ_LIMIT:
            raise AssertionError(f"{self} has a grid y/z over {GRID_YZ_LIMIT}")


def _walk(op, found):
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                found.append(child)
                _walk(child.operation, found)
    return found


def _constant(value: ir.Value) -> int:
    owner = value.owner
    if not isinstance(owner, ir.Operation):
        owner = owner.operation
    if owner.name != "arith.constant":
        raise ValueError(f"launch dimension is not a constant: {owner}")
    return ir.IntegerAttr(owner.attributes["value"]).value


def mosaic_launches(lowered) -> list[Launch]:
    """The launch of every Mosaic GPU kernel in ``lowered`` (a ``jax.stages.Lowered``)."""
    module = lowered.compiler_ir("stablehlo")
    launches = []
    with module.context:
        module.context.allow_unregistered_dialects = True
        for op in _walk(module.operation, []):
            op = op.operation
            if op.name != "stablehlo.custom_call":
                continue
            if ir.StringAttr(op.attributes["call_target_name"]).value != "mosaic_gpu_v2":
                continue
            config = ir.DictAttr(op.attributes["mhlo.backend_config"])
            kernel = ir.Module.parse(ir.StringAttr(config["module"]).value_bytes)
            # The module is stored in Mosaic's version-stable form; its pass (registered
            # by jaxlib) turns it back into upstream dialects, gpu.launch among them.
            pm = passmanager.PassManager.parse("builtin.module(mosaic_gpu-serde{serialize=false})")
            pm.run(kernel.operation)
            for inner in _walk(kernel.operation, []):
                inner = inner.operation
                if inner.name == "gpu.launch":
                    launches.append(_launch(inner))
    return launches


def _launch(op) -> Launch:
    # gpu.launch operands: async deps, grid x/y/z, block x/y/z, [cluster x/y/z], [smem].
    sizes = list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))
    operands = list(op.operands)
    groups, at = [], 0
    for n in sizes:
        groups.append(operands[at : at + n])
        at += n
    grid = tuple(_constant(v[0]) for v in groups[1:4])
    block = tuple(_constant(v[0]) for v in groups[4:7])
    smem = _constant(groups[-1][0]) if groups[-1] else 0
    return Launch(grid=grid, block=block, smem_bytes=smem)
