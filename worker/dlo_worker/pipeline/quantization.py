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
the FP8 step's dequantization cost (``docs/benchmarks.md``). On GPUs with FP8 conversion
instructions the cast is one Triton kernel (:func:`compute_weight`): PyTorch's own converts
FP8 at about a quarter of the GPU's memory bandwidth.

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

Quantizing is an edit of the loaded weights (:func:`fp8_weights`), made before the DiTs'
host backing is chosen: a runtime-cache entry then holds the FP8 weights and their
scales (each also a persistent buffer), so FP8 DiTs stream from the node's shared page
cache like bf16 ones, and a start whose entry is recorded binds a skeleton quantized the
same way to it without reading or quantizing the checkpoint (:func:`read_scales`).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from types import ModuleType

import torch
from torch import nn
from tqdm.auto import tqdm

from dlo_worker.loader.diffusers_loader import HostWeightEdit
from dlo_worker.observability import metrics
from dlo_worker.offload.plan import discover

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
FP8_IDENTITY = "quantization=fp8-per-tensor-e4m3"
"""What FP8 weights are, as the runtime cache's source and entry identities hold it."""


class Float8Linear(nn.Module):
    """A linear layer whose weight is FP8 (e4m3) with a per-tensor scale.

    Built from a meta ``nn.Linear`` (a skeleton), it holds meta tensors and no scale
    until the weights are bound and :func:`read_scales` reads them."""

    scale: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = linear.bias
        if linear.weight.is_meta:
            self.weight = nn.Parameter(
                torch.empty(linear.weight.shape, dtype=FP8_DTYPE, device="meta"),
                requires_grad=False,
            )
            self.register_buffer("scale", torch.empty((), dtype=torch.float32, device="meta"))
            self.weight_scale = math.nan
            return
        weight = linear.weight.detach().float()
        amax = weight.abs().amax()
        # An all-zero weight keeps scale 1: zeros quantize exactly either way. Computed in
        # float32 and kept as a Python number (exactly that float32 value): the GEMM's
        # ``alpha``, so the forward never reads it from the device.
        self.weight_scale = (amax / FP8_MAX).item() if amax > 0 else 1.0
        # Casting to e4m3fn does not saturate (beyond 448 it gives NaN): clamp.
        quantized = (weight / self.weight_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        self.weight = nn.Parameter(quantized, requires_grad=False)
        # The same float32 value as a tensor, so the state dict (a runtime-cache entry)
        # holds it.
        self.register_buffer("scale", torch.tensor(self.weight_scale, dtype=torch.float32))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as ``dtype`` (for inspection; the forward never builds it)."""
        return (self.weight.float() * self.weight_scale).to(dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = compute_weight(self.weight, hidden_states.dtype)
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


def compute_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight as ``dtype`` for its matmul (exact: e4m3 values fit in bf16).

    On a CUDA GPU with FP8 conversion instructions the cast is
    :mod:`~dlo_worker.pipeline.fp8_cast`'s Triton kernel (3.4-3.9x PyTorch's cast on an
    H200's large linears), once it has written ``Tensor.to``'s bits for every e4m3 code on
    that GPU; elsewhere, and inside a compiled graph (inductor writes its own cast),
    ``Tensor.to``. Resident and streamed layers both come here, so DLO's output stays
    bitwise the resident one."""
    if weight.is_cuda and weight.is_contiguous() and not torch.compiler.is_compiling():
        fast = _fast_cast(weight.get_device(), dtype)
        if fast is not None and weight.numel() <= fast.MAX_ELEMENTS:
            return fast.cast(weight, dtype)
    return weight.to(dtype)


FAST_CAST_CAPABILITY = (8, 9)
"""The first NVIDIA compute capability with FP8 conversion instructions (Ada, then Hopper
and later): Triton refuses e4m3 on older GPUs (A100, A10), which cast with ``Tensor.to``."""


def fast_cast_unavailable(cuda: str | None, capability: tuple[int, int]) -> str | None:
    """Why a GPU of ``capability`` on a torch built for CUDA ``cuda`` (``None``: another
    platform) cannot use the Triton cast, or ``None`` when it can (pure)."""
    if cuda is None:
        return "this torch is not built for CUDA (e4m3fn is NVIDIA's FP8 format)"
    if capability < FAST_CAST_CAPABILITY:
        return (
            f"compute capability {capability[0]}.{capability[1]} has no FP8 conversion "
            f"instructions (they start at {FAST_CAST_CAPABILITY[0]}.{FAST_CAST_CAPABILITY[1]})"
        )
    return None


def cast_difference(
    cast: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> str | None:
    """Where ``cast`` of all 256 e4m3 codes on ``device`` differs from ``Tensor.to``'s
    bits (the first such code), or ``None`` when it writes the same bits."""
    codes = torch.arange(256, dtype=torch.uint8, device=device).view(FP8_DTYPE)
    candidate, reference = cast(codes, dtype), codes.to(dtype)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    nan = reference.isnan()
    same = (candidate.isnan() == nan) & ((candidate.view(bits) == reference.view(bits)) | nan)
    if bool(same.all()):
        return None
    code = int((~same).nonzero()[0])
    return (
        f"e4m3 code 0x{code:02x} cast to {dtype} gave {candidate[code].item()} "
        f"where torch gives {reference[code].item()}"
    )


@functools.cache
def _fast_cast(device_index: int, dtype: torch.dtype) -> ModuleType | None:
    """The Triton cast to ``dtype`` on CUDA device ``device_index``, or ``None``."""
    return choose_cast(
        torch.version.cuda,
        torch.cuda.get_device_capability(device_index),
        torch.device("cuda", device_index),
        dtype,
        _load_kernel,
    )


def _load_kernel() -> ModuleType:
    from dlo_worker.pipeline import fp8_cast

    return fp8_cast


def choose_cast(
    cuda: str | None,
    capability: tuple[int, int],
    device: torch.device,
    dtype: torch.dtype,
    load_kernel: Callable[[], ModuleType],
) -> ModuleType | None:
    """The kernel module ``load_kernel`` gives, where the GPU has FP8 conversion
    instructions and the kernel writes ``Tensor.to``'s bits on ``device`` at ``dtype``;
    else ``None`` (``Tensor.to``), said once with why and counted in ``dlo_fp8_casts``."""
    unavailable = fast_cast_unavailable(cuda, capability)
    if unavailable is not None:
        _cast_by_torch("not-cuda" if cuda is None else "capability", unavailable, logging.INFO)
        return None
    try:
        kernel = load_kernel()
        difference = cast_difference(kernel.cast, device, dtype)
    # Importing Triton, compiling the kernel or building Triton's launcher (a C compiler):
    # whatever fails, torch's cast is correct, only slower.
    except Exception as failure:
        _cast_by_torch("failed", f"the Triton kernel failed: {failure!r}", logging.WARNING)
        return None
    if difference is not None:
        _cast_by_torch("differs", difference, logging.WARNING)
        return None
    metrics.FP8_CASTS.labels(cast="triton", reason="checked").inc()
    return kernel


def _cast_by_torch(reason: str, why: str, level: int) -> None:
    metrics.FP8_CASTS.labels(cast="torch", reason=reason).inc()
    logger.log(level, "fp8 weights cast by torch", extra={"fields": {"why": why}})


def quantize_blocks_fp8(
    model_or_pipeline: object,
    block_paths: Sequence[str] | None = None,
    skip_components: frozenset[str] = frozenset(),
) -> int:
    """Replace every ``nn.Linear`` inside the DiT blocks (found as DLO finds them) with a
    :class:`Float8Linear`; returns how many were replaced. Runs where the weights are,
    before DLO is enabled or the DiT moves to the device. DiTs in ``skip_components`` are
    bound to a runtime-cache entry that holds their FP8 weights (their scales are read
    once DLO has bound them: :func:`read_scales`)."""
    replaced = 0
    saved = 0
    plan = discover(model_or_pipeline, block_paths)
    blocks = [
        block for dit in plan.dits if dit.name not in skip_components for _, block in dit.blocks
    ]
    for block in tqdm(blocks, desc="FP8 weights", unit="block", disable=len(blocks) < 2):
        for parent, name, child in _linears(block):
            saved += child.weight.numel() * (child.weight.element_size() - 1)
            setattr(parent, name, Float8Linear(child))
            replaced += 1
    logger.info(
        "fp8 weights",
        extra={"fields": {"linears": replaced, "bytes_saved": saved}},
    )
    return replaced


def quantized_skeleton(skeleton: nn.Module, block_paths: Sequence[str] | None = None) -> None:
    """Give a DiT's meta skeleton the structure :func:`quantize_blocks_fp8` gives the loaded
    DiT (FP8 weights, scale buffers), so an entry built from that DiT binds to it."""
    for _, block in (pair for dit in discover(skeleton, block_paths).dits for pair in dit.blocks):
        for parent, name, child in _linears(block):
            setattr(parent, name, Float8Linear(child))


def read_scales(model_or_pipeline: object, block_paths: Sequence[str] | None = None) -> None:
    """Each :class:`Float8Linear`'s GEMM ``alpha`` from its ``scale`` buffer: for a DiT
    bound to a runtime-cache entry, once DLO has bound its tensors (before, they are meta
    and every ``alpha`` NaN, so a forward could only produce a refused image). Layers
    quantized here already know theirs: their scale is not read back from the device.
    The DiTs are found as they were quantized (``block_paths``: ``--dlo-block-paths``)."""
    for dit in discover(model_or_pipeline, block_paths).dits:
        for layer in dit.module.modules():
            if isinstance(layer, Float8Linear) and math.isnan(layer.weight_scale):
                layer.weight_scale = layer.scale.item()


def fp8_weights(block_paths: Sequence[str] | None = None) -> HostWeightEdit:
    """``--quantization fp8``: the edit the loader writes into the loaded DiTs (and into a
    skip-load skeleton's structure), keyed by :data:`FP8_IDENTITY`."""

    def apply(pipeline: object, skip: frozenset[str]) -> None:
        quantize_blocks_fp8(pipeline, block_paths, skip)

    return HostWeightEdit(
        identity=(FP8_IDENTITY,),
        apply=apply,
        skeleton=lambda dit: quantized_skeleton(dit, block_paths),
    )


def _linears(block: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [
        (parent, name, child)
        for parent in list(block.modules())
        for name, child in list(parent.named_children())
        if type(child) is nn.Linear
    ]
