"""Online FP8 weight quantization of the DiT blocks (``--quantization fp8``).

Every ``nn.Linear`` inside the blocks DLO streams becomes a :class:`Float8Linear`: its
weight is stored as ``float8_e4m3fn`` with one float32 scale per tensor
(``amax / 448``, the design's per-tensor FP8), and its forward dequantizes the weight to
the activation dtype on the device right before the matmul. So host memory, the bytes
copied per step and each AllGather shard halve against bf16 (the weight is a
parameter DLO packs like any other, one byte per element; the scale is a buffer and stays
on the device), while activations and accumulation stay in the compute dtype.

Dequantize-then-matmul rather than an FP8 matmul (``torch._scaled_mm``): it runs on
every device (the CPU included, so CI checks it), it is the same kernel sequence whether
the weight was streamed or resident (DLO's bitwise rule), and it keeps activations in
bf16 for quality; an offloaded step is bound by the copies, not the matmuls, so FP8
compute would not shorten it. Weights outside the blocks (embedders, final projection)
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
from torch.nn import functional
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
        # An all-zero weight keeps scale 1: zeros quantize exactly either way. The scale is
        # rounded to the compute dtype first, since the forward multiplies by that value.
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        scale = scale.to(linear.weight.dtype)
        # Casting to e4m3fn does not saturate (beyond 448 it gives NaN): clamp.
        quantized = (weight / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        self.weight = nn.Parameter(quantized, requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype) * self.weight_scale.to(dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return functional.linear(
            hidden_states, self.dequantized_weight(hidden_states.dtype), self.bias
        )

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
