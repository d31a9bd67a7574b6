"""On CUDA (bf16): a DLO model compiled with the standard API runs the resident compiled
model's graphs, bitwise, with its hooks eager and no recompile in steady state; with CUDA
graphs (``--compile-mode reduce-overhead``) it replays the resident model's graphs."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch._inductor.cudagraph_trees import MarkStepBox

from dlo_worker.config import CompileMode
from dlo_worker.offload import OffloadStats, enable_dlo
from dlo_worker.pipeline.compilation import compile_blocks
from tests.support.tiny_models import TinyCase, tiny_flux

CUDA = torch.device("cuda")


def _forwards(model: torch.nn.Module, inputs: dict, count: int = 3) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(**inputs).sample.cpu() for _ in range(count)]


def _tiny_flux_bf16() -> tuple[TinyCase, dict]:
    """Tiny Flux (2 double and 3 single blocks: an odd count, so under DLO a block's slot
    alternates between forwards) in bf16, with its inputs on CUDA."""
    case = tiny_flux(0)
    case.model.to(torch.bfloat16)
    inputs = {
        key: value.to(CUDA, torch.bfloat16) if value.is_floating_point() else value.to(CUDA)
        for key, value in case.inputs.items()
    }
    return case, inputs


def test_dlo_compiled_flux_is_bitwise_equal_to_resident_compiled_on_cuda() -> None:
    case, inputs = _tiny_flux_bf16()
    resident = copy.deepcopy(case.model).to(CUDA)
    resident.compile_repeated_blocks(fullgraph=True)
    expected = _forwards(resident, inputs)
    backend = enable_dlo(case.model, device=CUDA, use_allgather=False)
    try:
        case.model.compile_repeated_blocks(fullgraph=True)
        streamed = _forwards(case.model, inputs)
        stats = backend.stats()
    finally:
        backend.disable()
    assert all(torch.equal(a, b) for a, b in zip(expected, streamed, strict=True))
    assert stats.compiled_blocks == stats.streamed_blocks > 0
    assert stats.recompiles == 0


def _cuda_graph_forwards(
    model: torch.nn.Module, inputs: dict, dlo: dict[str, Any] | None = None
) -> tuple[list[torch.Tensor], OffloadStats | None]:
    """Six forwards of ``model`` compiled with CUDA graphs, under DLO (with enable_dlo's
    options ``dlo``) unless ``dlo`` is None: forwards 1-3 warm up and record (a second
    recording per slot parity under DLO), 4-6 replay; each forward is one CUDA graph step."""
    backend = None
    if dlo is not None:
        backend = enable_dlo(model, device=CUDA, use_allgather=False, **dlo)
    try:
        compile_blocks(model, CompileMode.REDUCE_OVERHEAD, CUDA)
        steps = MarkStepBox.mark_step_counter
        outputs = _forwards(model, inputs, 6)
        assert MarkStepBox.mark_step_counter == steps - 6
        return outputs, backend.stats() if backend is not None else None
    finally:
        if backend is not None:
            backend.disable()


def test_dlo_with_cuda_graphs_replays_the_resident_graphs_bitwise() -> None:
    case, inputs = _tiny_flux_bf16()
    expected, _ = _cuda_graph_forwards(copy.deepcopy(case.model).to(CUDA), inputs)
    streamed, stats = _cuda_graph_forwards(case.model, inputs, dlo={})
    assert all(torch.equal(a, b) for a, b in zip(expected, streamed, strict=True))
    assert stats is not None
    assert stats.compiled_blocks == stats.streamed_blocks > 0
    assert stats.on_demand_loads == 0


def test_cuda_graphs_with_every_block_kept_resident_by_a_budget() -> None:
    """A budget large enough for every block leaves DLO nothing to stream: the worker's
    compilation marks the steps (DLO's block compilation owns none), once per forward."""
    case, inputs = _tiny_flux_bf16()
    expected, _ = _cuda_graph_forwards(copy.deepcopy(case.model).to(CUDA), inputs)
    kept, stats = _cuda_graph_forwards(case.model, inputs, dlo={"gpu_memory_budget_gib": 64})
    assert all(torch.equal(a, b) for a, b in zip(expected, kept, strict=True))
    assert stats is not None
    assert (stats.streamed_blocks, stats.resident_blocks) == (0, 5)
    assert stats.compiled_blocks == 0


def _flux_class_blocks(seed: int = 0) -> torch.nn.Module:
    """Flux's real widths (24 heads of 128, a 4096-wide text stream) with 2 double and 3
    single blocks, random bf16 weights on the CPU: the matrix shapes whose kernels
    inductor chooses by size, in a model that compiles in seconds."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    )
    return model.to(torch.bfloat16).eval()


def _flux_class_inputs(resolution: int) -> dict[str, torch.Tensor]:
    tokens, text = (resolution // 16) ** 2, 512  # 8x VAE downsampling, then 2x2 packing
    g = torch.Generator(device=CUDA).manual_seed(resolution)
    bf16 = torch.bfloat16
    return {
        "hidden_states": torch.randn(1, tokens, 64, device=CUDA, dtype=bf16, generator=g),
        "encoder_hidden_states": torch.randn(1, text, 4096, device=CUDA, dtype=bf16, generator=g),
        "pooled_projections": torch.randn(1, 768, device=CUDA, dtype=bf16, generator=g),
        "timestep": torch.tensor([1.0], device=CUDA, dtype=bf16),
        "guidance": torch.tensor([3.5], device=CUDA, dtype=bf16),
        "img_ids": torch.zeros(tokens, 3, device=CUDA),
        "txt_ids": torch.zeros(text, 3, device=CUDA),
    }


def _compiled_outputs_by_size(model: torch.nn.Module, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """``--compile``'s graphs from a clean Dynamo: static at the first size, dynamic from
    the second; each size's output after two forwards."""
    torch._dynamo.reset()
    compile_blocks(model, CompileMode.DEFAULT, CUDA)
    outputs = []
    for size in sizes:
        outputs.extend(_forwards(model, _flux_class_inputs(size), 2))
    return outputs


def test_dlo_compiled_is_bitwise_equal_to_resident_compiled_at_256_and_1024_on_cuda() -> None:
    """At 256x256 a Flux-class step is launch-bound and its matrices are small, where
    kernel choices differ most (issue 61 saw 0.035 at 256x256 in bench/flux_compile.py);
    1024x1024 is the second size, compiled dynamic."""
    sizes = (256, 1024)
    model = _flux_class_blocks()
    expected = _compiled_outputs_by_size(copy.deepcopy(model).to(CUDA), sizes)
    backend = enable_dlo(model, device=CUDA, use_allgather=False)
    try:
        streamed = _compiled_outputs_by_size(model, sizes)
        stats = backend.stats()
    finally:
        backend.disable()
    assert stats.compiled_blocks == stats.streamed_blocks == 5
    for expected_output, streamed_output in zip(expected, streamed, strict=True):
        assert torch.equal(expected_output, streamed_output)
