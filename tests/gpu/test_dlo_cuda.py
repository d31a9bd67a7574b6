"""DLO on CUDA: bitwise equality with streams and events; NCCL AllGather over two GPUs.

Run on the accelerator machine: ``pytest tests/gpu``. Collected only where CUDA exists.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dlo_worker.offload import enable_dlo
from tests.support.equivalence import RANK_LOCAL_CASES, check_allgather_rank, run_equivalence
from tests.support.tiny_models import plain_stack, tiny_flux

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("case", RANK_LOCAL_CASES)
def test_rank_local_streaming_on_cuda_is_bitwise_equal(case: str) -> None:
    model, options = RANK_LOCAL_CASES[case]
    result = run_equivalence(model, CUDA, **options)
    assert result.bitwise_equal
    assert result.stats.host_page_locked
    assert result.stats.on_demand_loads == 0


@pytest.mark.parametrize("resident_layers", [1, 3])
def test_resident_layers_on_cuda_are_bitwise_equal(resident_layers: int) -> None:
    assert run_equivalence("flux", CUDA, resident_layers=resident_layers).bitwise_equal


def test_bf16_flux_on_cuda_is_bitwise_equal() -> None:
    case = tiny_flux()
    case.model.to(torch.bfloat16)
    reference = tiny_flux().model.to(torch.bfloat16).to(CUDA)
    inputs = {
        k: v.to(CUDA, torch.bfloat16) if v.is_floating_point() else v.to(CUDA)
        for k, v in case.inputs.items()
    }
    with torch.inference_mode():
        expected = [reference(**inputs).sample for _ in range(3)]
    backend = enable_dlo(case.model, device=CUDA, use_allgather=False)
    with torch.inference_mode():
        actual = [case.model(**inputs).sample for _ in range(3)]
    backend.disable()
    assert all(torch.equal(a, b) for a, b in zip(expected, actual, strict=True))


def test_hot_path_never_synchronizes_the_host() -> None:
    """With CUDA's sync debug mode set to error, any host-side synchronize raises."""
    case = plain_stack(blocks=6)
    inputs = {"x": case.inputs["x"].to(CUDA)}
    backend = enable_dlo(case.model, device=CUDA, use_allgather=False)
    with torch.inference_mode():
        case.model(**inputs)  # warm-up: first-call allocations
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                case.model(**inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    backend.disable()


def _nccl_rank(rank: int, world_size: int, store_path: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        device_id=device,
    )
    try:
        check_allgather_rank(device)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_nccl_allgather_over_two_gpus_is_bitwise_equal(tmp_path: Path) -> None:
    mp.spawn(_nccl_rank, args=(2, str(tmp_path / "store")), nprocs=2, join=True)


def test_fp8_flux_on_cuda_is_bitwise_equal_to_fp8_resident() -> None:
    """``--quantization fp8``: the FP8 weights stream through the slots (one byte each) and
    are dequantized on the GPU; the output equals the same FP8 model resident."""
    from dlo_worker.pipeline.quantization import quantize_blocks_fp8

    def fp8_flux() -> torch.nn.Module:
        model = tiny_flux().model.to(torch.bfloat16)
        quantize_blocks_fp8(model)
        return model

    case = tiny_flux()
    inputs = {
        k: v.to(CUDA, torch.bfloat16) if v.is_floating_point() else v.to(CUDA)
        for k, v in case.inputs.items()
    }
    reference = fp8_flux().to(CUDA)
    with torch.inference_mode():
        expected = [reference(**inputs).sample for _ in range(3)]
    model = fp8_flux()
    backend = enable_dlo(model, device=CUDA, use_allgather=False)
    with torch.inference_mode():
        actual = [model(**inputs).sample for _ in range(3)]
    backend.disable()
    assert all(torch.equal(a, b) for a, b in zip(expected, actual, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_fp8_cast_kernel_writes_the_bits_torch_writes(dtype: torch.dtype) -> None:
    """The FP8 layers cast with the Triton kernel on this GPU (its check before use passed),
    and every e4m3 code (NaN too), at a length no kernel program divides, comes out as
    ``Tensor.to`` writes it."""
    from dlo_worker.pipeline import fp8_cast, quantization

    assert quantization._fast_cast(CUDA.index, dtype) is fp8_cast, "the FP8 layers cast slowly"
    codes = torch.arange(256, dtype=torch.uint8, device=CUDA).repeat(4099)[:-7]
    weight = codes.view(torch.float8_e4m3fn).reshape(-1, 3)
    fast, torch_cast = fp8_cast.cast(weight, dtype), weight.to(dtype)
    assert fast.dtype == dtype
    assert fast.shape == weight.shape
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    nan = torch_cast.isnan()
    assert torch.equal(fast.isnan(), nan)
    assert torch.equal(fast[~nan].view(bits), torch_cast[~nan].view(bits))
