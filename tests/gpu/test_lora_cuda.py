"""On CUDA (bf16): LoRA adapters on a DLO DiT, eager and compiled (``--compile`` default
and CUDA graphs), chosen per forward as the worker chooses them per request: bitwise
equal to the resident model with the same adapters and choices, and under ``--compile``
switching adapters or scales recompiles nothing. On two GPUs: the worker with compiled
blocks, a fused and two chosen adapters over NCCL AllGather writes the resident bytes."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlo_worker.config import CompileMode
from dlo_worker.offload import enable_dlo
from dlo_worker.pipeline.compilation import compile_blocks
from dlo_worker.pipeline.lora import AdapterSelection
from tests.gpu.test_compile_cuda import CUDA, _tiny_flux_bf16
from tests.support.generate import ENV, digest
from tests.support.lora import ATTENTION_PROJECTIONS, write_flux_lora

CHOICES: list[tuple[tuple[str, float], ...]] = [
    (("a", 1.0),),
    (("a", 0.5), ("b", -1.0)),
    (),
    (("b", 0.3),),
    (("a", 1.0),),
]


def _with_adapters(model: torch.nn.Module) -> None:
    """Adapters a and b, random (seeded) A and B, added where the model's weights are."""
    from peft import LoraConfig

    for seed, name in enumerate(("a", "b"), start=1):
        torch.manual_seed(seed)
        config = LoraConfig(
            r=4, lora_alpha=4, target_modules=list(ATTENTION_PROJECTIONS), init_lora_weights=False
        )
        model.add_adapter(config, adapter_name=name)  # type: ignore[operator]


def _run(
    model: torch.nn.Module, inputs: dict, mode: CompileMode | None
) -> tuple[list[torch.Tensor], int]:
    """One forward per choice in :data:`CHOICES`; the outputs and the recompiles."""
    selection = AdapterSelection()
    compiled = None
    if mode is not None:
        torch._dynamo.reset()
        selection.for_compiled_blocks(model, CUDA)
        compiled = compile_blocks(model, mode, CUDA)
    outputs = []
    for choice in CHOICES:
        selection.select(model, choice)
        with torch.inference_mode():
            outputs.append(model(**inputs).sample.cpu())
    return outputs, compiled.recompiles if compiled is not None else 0


@pytest.mark.parametrize("mode", [None, CompileMode.DEFAULT, CompileMode.REDUCE_OVERHEAD], ids=str)
def test_adapters_chosen_per_forward_are_bitwise_equal_to_resident_on_cuda(
    mode: CompileMode | None,
) -> None:
    case, inputs = _tiny_flux_bf16()
    resident = copy.deepcopy(case.model).to(CUDA)
    _with_adapters(resident)
    expected, resident_recompiles = _run(resident, inputs, mode)
    backend = enable_dlo(case.model, device=CUDA, use_allgather=False)
    try:
        _with_adapters(case.model)  # after enable, as the worker loads them
        streamed, recompiles = _run(case.model, inputs, mode)
        stats = backend.stats()
    finally:
        backend.disable()
    assert all(torch.equal(a, b) for a, b in zip(expected, streamed, strict=True))
    assert torch.equal(streamed[0], streamed[-1])  # the same choice, after three others
    # Each choice applied: no two of the four choices draw the same output.
    assert not any(torch.equal(streamed[i], streamed[j]) for i in range(4) for j in range(i))
    assert recompiles == resident_recompiles == 0
    assert stats.streamed_blocks > 0


def _generate(model: Path, out: Path, seed: int, *flags: str, ranks: int = 1) -> str:
    """``dlo-worker generate`` on CUDA (bf16), one process or ``ranks`` torchrun ranks."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        if ranks > 1
        else []
    )
    command = [
        sys.executable,
        *launcher,
        "-m",
        "dlo_worker",
        "generate",
        "--model",
        str(model),
        "--prompt",
        "a red fox",
        "--width",
        "128",
        "--height",
        "128",
        "--steps",
        "4",
        "--seed",
        str(seed),
        "--log-level",
        "info",
        "--out",
        str(out),
        *flags,
    ]
    result = subprocess.run(
        command, env=ENV, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_compiled_adapters_over_nccl_allgather_write_each_ranks_resident_bytes(
    flux_model_dir: Path, tmp_path: Path
) -> None:
    """DP=2 DLO AllGather on NCCL with --compile, one adapter fused and two chosen per
    image: each rank writes the bytes of the resident compiled worker at its seed."""
    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(flux_model_dir / "transformer")
    adapters = {
        name: write_flux_lora(transformer, tmp_path / name, seed)
        for name, seed in (("a", 1), ("b", 2), ("f", 3))
    }
    flags = (
        "--compile",
        "--lora",
        f"a={adapters['a']}:0.7,b={adapters['b']},f={adapters['f']}:0.5",
        "--fuse-lora",
        "f",
        "--use-lora",
        "a:0.5",
        "--use-lora",
        "b:-1",
    )
    for seed in (7, 8):
        _generate(flux_model_dir, tmp_path / f"resident-{seed}.png", seed, *flags)
    dp = ("--enable-distributed-layerwise-offload", "--data-parallel-size", "2")
    output = _generate(flux_model_dir, tmp_path / "dp.png", 7, *flags, *dp, ranks=2)
    assert "transfer_mode=allgather" in output
    assert digest(tmp_path / "dp.png") == digest(tmp_path / "resident-7.png")
    assert digest(tmp_path / "dp.dp1.png") == digest(tmp_path / "resident-8.png")
