"""On CUDA (bf16): a DLO model compiled with the standard API runs the resident compiled
model's graphs, bitwise, with its hooks eager and no recompile in steady state."""

from __future__ import annotations

import copy

import torch

from dlo_worker.offload import enable_dlo
from tests.support.tiny_models import tiny_flux

CUDA = torch.device("cuda")


def _forwards(model: torch.nn.Module, inputs: dict, count: int = 3) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(**inputs).sample.cpu() for _ in range(count)]


def test_dlo_compiled_flux_is_bitwise_equal_to_resident_compiled_on_cuda() -> None:
    case = tiny_flux(0)
    case.model.to(torch.bfloat16)
    inputs = {
        key: value.to(CUDA, torch.bfloat16) if value.is_floating_point() else value.to(CUDA)
        for key, value in case.inputs.items()
    }
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
