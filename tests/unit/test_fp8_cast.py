"""The FP8 layers' Triton cast (``dlo_worker.pipeline.fp8_cast``): on the CPU, in Triton's
interpreter, it writes the bits ``Tensor.to`` writes for every finite e4m3 code; the check
a GPU runs before using it finds a cast that differs; GPUs without FP8 conversion
instructions are told apart. ``tests/gpu`` checks the compiled kernel, NaN codes included."""

from __future__ import annotations

import importlib.util
import logging
from types import ModuleType, SimpleNamespace

import pytest
import torch
from prometheus_client import REGISTRY

from dlo_worker.pipeline.quantization import (
    cast_difference,
    choose_cast,
    fast_cast_unavailable,
)

CPU = torch.device("cpu")


def casts(cast: str, reason: str) -> float:
    return REGISTRY.get_sample_value("dlo_fp8_casts_total", {"cast": cast, "reason": reason}) or 0


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A copy of ``fp8_cast`` whose kernel runs in Triton's interpreter (on CPU tensors)."""
    # Triton ships with PyTorch's Linux wheels (what CI installs), not with macOS's.
    pytest.importorskip("triton", reason="Triton is not installed with this torch")
    from dlo_worker.pipeline import fp8_cast

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("fp8_cast_interpreted", fp8_cast.__file__)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_finite_e4m3_code_casts_to_the_bits_torch_writes(
    interpreted: ModuleType, dtype: torch.dtype
) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    # Less e4m3fn's NaN codes (0x7f, 0xff): the interpreter reads them as +-480, and the
    # GPU test and the check before use cover them.
    finite = codes[(codes & 0x7F) != 0x7F]
    # More than one program's elements, at a length no program divides.
    length = interpreted.ELEMENTS_PER_PROGRAM + 3 * 254 + 1
    weight = finite.repeat(length // len(finite) + 1)[:length].view(torch.float8_e4m3fn)
    weight = weight.reshape(-1, 1)
    cast = interpreted.cast(weight, dtype)
    assert cast.dtype == dtype
    assert cast.shape == weight.shape
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(cast.view(bits), weight.to(dtype).view(bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_check_before_use_finds_a_cast_that_differs_in_one_code(dtype: torch.dtype) -> None:
    def nan_as_zero(weight: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        return weight.to(to).nan_to_num(0.0)

    def exact(weight: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        return weight.to(to)

    assert cast_difference(exact, torch.device("cpu"), dtype) is None
    difference = cast_difference(nan_as_zero, torch.device("cpu"), dtype)
    assert difference == f"e4m3 code 0x7f cast to {dtype} gave 0.0 where torch gives nan"


@pytest.mark.parametrize(
    ("cuda", "capability", "reason"),
    [
        ("12.8", (9, 0), None),  # H100, H200
        ("13.0", (8, 9), None),  # L4, L40S, RTX 4090
        ("13.0", (10, 0), None),  # B200
        ("12.8", (8, 6), "compute capability 8.6 has no FP8 conversion instructions"),  # A10
        ("12.8", (8, 0), "compute capability 8.0 has no FP8 conversion instructions"),  # A100
        (None, (9, 4), "this torch is not built for CUDA"),  # ROCm
    ],
)
def test_only_gpus_with_fp8_conversion_instructions_use_the_kernel(
    cuda: str | None, capability: tuple[int, int], reason: str | None
) -> None:
    said = fast_cast_unavailable(cuda, capability)
    if reason is None:
        assert said is None
    else:
        assert said is not None
        assert said.startswith(reason)


def test_a_kernel_that_writes_torchs_bits_is_chosen_and_counted() -> None:
    exact = SimpleNamespace(cast=lambda weight, dtype: weight.to(dtype))
    before = casts("triton", "checked")
    assert choose_cast("12.8", (9, 0), CPU, torch.bfloat16, lambda: exact) is exact
    assert casts("triton", "checked") == before + 1


def test_a_kernel_that_cannot_be_built_falls_back_said_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def no_compiler() -> ModuleType:
        raise RuntimeError("Failed to find C compiler")

    before = casts("torch", "failed")
    with caplog.at_level(logging.WARNING, logger="dlo_worker.pipeline.quantization"):
        assert choose_cast("12.8", (9, 0), CPU, torch.bfloat16, no_compiler) is None
    assert casts("torch", "failed") == before + 1
    [record] = caplog.records
    assert record.getMessage() == "fp8 weights cast by torch"
    assert "Failed to find C compiler" in record.fields["why"]


def test_a_kernel_that_writes_other_bits_falls_back_counted(interpreted: ModuleType) -> None:
    """Triton's interpreter reads e4m3fn's NaN codes as +-480: a real kernel that differs."""
    before = casts("torch", "differs")
    assert choose_cast("12.8", (9, 0), CPU, torch.float32, lambda: interpreted) is None
    assert casts("torch", "differs") == before + 1


def test_a_gpu_without_fp8_instructions_never_loads_the_kernel() -> None:
    def must_not_load() -> ModuleType:
        raise AssertionError("loaded the kernel on an A100")

    before = casts("torch", "capability")
    assert choose_cast("12.8", (8, 0), CPU, torch.bfloat16, must_not_load) is None
    assert casts("torch", "capability") == before + 1
