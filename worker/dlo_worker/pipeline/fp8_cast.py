"""The cast of FP8 (e4m3) weights to the compute dtype on CUDA, as one Triton kernel.

PyTorch's own cast (``Tensor.to``) converts FP8 elementwise at about 1 TB/s on an H200,
and that is most of what an FP8 step costs over a bf16 one there (31 ms of 0.20 s at
1024x1024 on the Flux-class DiT). This kernel converts with the GPU's conversion
instructions and ran at 3.4-3.9 TB/s on the Flux-class linears, where ``torch.compile``
of the same cast reached 1.2-2.0 TB/s (``docs/benchmarks.md``). Every finite e4m3 value
is exact in bf16, fp16 and fp32, so it writes the bits ``Tensor.to`` writes: CI checks
every code in Triton's interpreter, ``tests/gpu`` on the GPU.

Imported only for a CUDA GPU that has the instructions
(:func:`dlo_worker.pipeline.quantization.compute_weight` decides; Triton ships with
PyTorch's CUDA wheels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ELEMENTS_PER_PROGRAM = 8192
MAX_ELEMENTS = 2**31 - ELEMENTS_PER_PROGRAM
"""The kernel's offsets are 32-bit: a larger weight is cast by ``Tensor.to``."""


@triton.jit
def _cast_kernel(source, target, numel, block: tl.constexpr):
    offsets = tl.program_id(0) * block + tl.arange(0, block)
    inside = offsets < numel
    values = tl.load(source + offsets, mask=inside)
    tl.store(target + offsets, values.to(target.dtype.element_ty), mask=inside)


def cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (contiguous, at most :data:`MAX_ELEMENTS`) as ``dtype``, in a new tensor
    on its device."""
    output = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    numel = weight.numel()
    grid = (triton.cdiv(numel, ELEMENTS_PER_PROGRAM),)
    _cast_kernel[grid](weight, output, numel, block=ELEMENTS_PER_PROGRAM)
    return output
