"""Online FP8 weight quantization of the DiT blocks (``--quantization fp8``).

Every ``nn.Linear`` inside the blocks DLO streams becomes a :class:`Float8Linear`: its
weight is stored as ``float8_e4m3fn`` with one float32 scale per tensor
(``amax / 448``, the design's per-tensor FP8), and its forward casts the weight to the
activation dtype on the device right before the matmul, which applies the scale as its
``alpha``. So host memory, the bytes copied per step and each AllGather shard halve
against bf16 (the weight is a parameter DLO packs like any other, one byte per element;
the scale is a Python number, fixed at quantization), while activations and
accumulation stay in the compute dtype.

Why the scale is the GEMM's ``alpha`` and not a multiply of the weight: every e4m3 value
is exact in bf16, so the cast loses nothing, and cuBLAS (and the CPU's GEMM) applies
``alpha`` to the float32 accumulator in the epilogue: one elementwise pass over the
weight (the cast) instead of two (cast, then multiply in a full-size temporary), and no
rounding of the scaled weight to bf16. On an H200 the second pass was about a third of
the FP8 step's dequantization cost (``docs/benchmarks.md``).

Dequantize-then-matmul rather than an FP8 matmul (``torch._scaled_mm``): it runs on
every device (the CPU included, so CI checks it), it is the same kernel sequence whether
the weight was streamed or resident (DLO's bitwise rule), and it keeps activations in
bf16 for quality. Measured on an H200, an FP8 GEMM with activations quantized per tensor
on the fly was no faster resident, left the FP8 DLO step where it was, and cost 2 dB of
PSNR against bf16 (``docs/benchmarks.md``). Weights outside the blocks (embedders, final projection)
stay in the compute dtype: they are resident and small, and the first and last layers
are the most sensitive to quantization.

Tensor subclasses (torchao's float8 weight-only, optimum-quanto) would do the same
arithmetic, but DLO packs plain tensors into flat per-dtype buffers and moves their
storage, which a subclass hides behind its own layout.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from dlo_worker.offload.plan import discover

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


class Float8Linear(nn.Module):
    """A linear layer whose weight is FP8 (e4m3) with a per-tensor scale."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().float()
        amax = weight.abs().amax()
        # An all-zero weight keeps scale 1: zeros quantize exactly either way. Computed in
        # float32 and kept as a Python number (exactly that float32 value): the GEMM's
        # ``alpha``, so the forward never reads it from the device.
        self.weight_scale = (amax / FP8_MAX).item() if amax > 0 else 1.0
        # Casting to e4m3fn does not saturate (beyond 448 it gives NaN): clamp.
        quantized = (weight / self.weight_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        self.weight = nn.Parameter(quantized, requires_grad=False)
        self.bias = linear.bias

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as ``dtype`` (for inspection; the forward never builds it)."""
        return (self.weight.float() * self.weight_scale).to(dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(hidden_states.dtype)  # exact: e4m3 values fit in bf16
        flat = hidden_states.reshape(-1, self.in_features)
        bias = self.bias if self.bias is not None else flat.new_zeros(())
        output = torch.addmm(
            bias,
            flat,
            weight.t(),
            beta=1 if self.bias is not None else 0,
            alpha=self.weight_scale,
        )
        return output.view(*hidden_states.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight=float8_e4m3fn per-tensor"
        )


def quantize_blocks_fp8(model_or_pipeline: object, block_paths: Sequence[str] | None = None) -> int:
    """Replace every ``nn.Linear`` inside the DiT blocks (found as DLO finds them) with a
    :class:`Float8Linear`; returns how many were replaced. Runs where the weights are,
    before DLO is enabled or the DiT moves to the device."""
    replaced = 0
    saved = 0
    blocks = [
        block for dit in discover(model_or_pipeline, block_paths).dits for _, block in dit.blocks
    ]
    for block in tqdm(blocks, desc="FP8 weights", unit="block", disable=len(blocks) < 2):
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    saved += child.weight.numel() * (child.weight.element_size() - 1)
                    setattr(parent, name, Float8Linear(child))
                    replaced += 1
    logger.info(
        "fp8 weights",
        extra={"fields": {"linears": replaced, "bytes_saved": saved}},
    )
    return replaced
