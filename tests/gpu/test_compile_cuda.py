"""On CUDA (bf16): a DLO model compiled with the standard API runs the resident compiled
model's graphs, bitwise, with its hooks eager and no recompile in steady state; with CUDA
graphs (``--compile-mode reduce-overhead``) it replays the resident model's graphs."""

from __future__ import annotations

import copy

import torch
from torch._inductor.cudagraph_trees import MarkStepBox

from dlo_worker.config import CompileMode
from dlo_worker.offload import enable_dlo
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


def test_dlo_with_cuda_graphs_replays_the_resident_graphs_bitwise() -> None:
    case, inputs = _tiny_flux_bf16()
    resident = copy.deepcopy(case.model).to(CUDA)
    compile_blocks(resident, CompileMode.REDUCE_OVERHEAD, CUDA)
    # Forwards 1-3 warm up and record (a second recording per slot parity under DLO).
    steps = MarkStepBox.mark_step_counter
    expected = _forwards(resident, inputs, 6)
    assert MarkStepBox.mark_step_counter == steps - 6  # one CUDA graph step per forward
    backend = enable_dlo(case.model, device=CUDA, use_allgather=False)
    try:
        compile_blocks(case.model, CompileMode.REDUCE_OVERHEAD, CUDA)
        steps = MarkStepBox.mark_step_counter
        streamed = _forwards(case.model, inputs, 6)
        assert MarkStepBox.mark_step_counter == steps - 6
        stats = backend.stats()
    finally:
        backend.disable()
    assert all(torch.equal(a, b) for a, b in zip(expected, streamed, strict=True))
    assert stats.compiled_blocks == stats.streamed_blocks > 0
    assert stats.on_demand_loads == 0
