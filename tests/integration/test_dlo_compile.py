"""torch.compile on a DLO model (in process, inductor's CPU backend): the standard APIs
either run, bitwise equal to the resident model compiled the same way, or fail at once
with one error naming the supported way; no recompile in steady state."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY
from torch import nn
from torch._inductor.cudagraph_trees import MarkStepBox

from dlo_worker.config import CompileMode
from dlo_worker.observability import metrics
from dlo_worker.offload import OffloadSetupError, enable_dlo
from dlo_worker.pipeline.compilation import compile_blocks
from tests.support.tiny_models import TinyCase, tiny_dit, tiny_flux

FORWARDS = 3
CPU = torch.device("cpu")


def _forwards(model: nn.Module, inputs: dict, count: int = FORWARDS) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [_sample(model(**inputs)) for _ in range(count)]


def _sample(output: object) -> torch.Tensor:
    return output.sample if hasattr(output, "sample") else output  # type: ignore[no-any-return,attr-defined]


def _compile_repeated(model: nn.Module) -> None:
    model.compile_repeated_blocks(fullgraph=True)  # type: ignore[operator]


def _compile_discovered(model: nn.Module) -> None:
    compile_blocks(model, CompileMode.DEFAULT, CPU)


def _compile_first_block_by_hand(model: nn.Module) -> None:
    blocks = model.transformer_blocks  # type: ignore[union-attr]
    blocks[0] = torch.compile(blocks[0], fullgraph=True)  # type: ignore[index]


COMPILERS: dict[str, tuple[Callable[[int], TinyCase], Callable[[nn.Module], None]]] = {
    "flux-compile_repeated_blocks": (tiny_flux, _compile_repeated),
    "dit-block.compile": (tiny_dit, _compile_discovered),
    "flux-torch.compile(block)": (tiny_flux, _compile_first_block_by_hand),
}


@pytest.mark.parametrize("way", COMPILERS)
def test_a_dlo_model_compiled_the_standard_way_is_bitwise_equal_to_resident_compiled(
    way: str,
) -> None:
    build, compile_model = COMPILERS[way]
    case = build(0)
    resident = copy.deepcopy(case.model)
    compile_model(resident)
    expected = _forwards(resident, case.inputs)
    eager = _forwards(copy.deepcopy(case.model), case.inputs, 1)[0]

    backend = enable_dlo(case.model, device="cpu", use_allgather=False)
    try:
        compile_model(case.model)
        streamed = _forwards(case.model, case.inputs)
        stats = backend.stats()
    finally:
        backend.disable()
    assert all(torch.equal(a, b) for a, b in zip(expected, streamed, strict=True))
    assert stats.blocks_loaded >= FORWARDS * stats.streamed_blocks
    assert stats.recompiles == 0
    if way != "flux-torch.compile(block)":
        # Every block runs inductor's kernels, so compiled and eager outputs differ.
        assert stats.compiled_blocks == stats.streamed_blocks
        assert not torch.equal(streamed[0], eager)


def test_a_new_input_size_is_counted_as_a_recompile_and_the_next_forward_is_not() -> None:
    case = tiny_dit(0)
    backend = enable_dlo(case.model, device="cpu", use_allgather=False)
    try:
        compile_blocks(case.model, CompileMode.DEFAULT, CPU)
        _forwards(case.model, case.inputs, 2)
        assert backend.stats().recompiles == 0
        larger = {**case.inputs, "hidden_states": torch.randn(2, 4, 16, 16)}
        _forwards(case.model, larger, 1)
        after_new_size = backend.stats().recompiles
        _forwards(case.model, larger, 2)
        assert after_new_size > 0
        assert backend.stats().recompiles == after_new_size
    finally:
        backend.disable()


def test_a_whole_dit_graph_fails_at_its_first_call_naming_the_supported_way() -> None:
    case = tiny_flux(0)
    backend = enable_dlo(case.model, device="cpu", use_allgather=False)
    try:
        whole = torch.compile(case.model, fullgraph=True)
        with pytest.raises(RuntimeError, match="compile_repeated_blocks") as raised:
            _forwards(whole, case.inputs, 1)
        assert "DLO streams this block's weights from eager hooks" in str(raised.value)
        # Without fullgraph the graph breaks at each block and DLO's hooks run eagerly.
        resident = _forwards(copy.deepcopy(tiny_flux(0).model), case.inputs, 1)[0]
        broken = _forwards(torch.compile(case.model), case.inputs, 1)[0]
        torch.testing.assert_close(broken, resident, rtol=1e-4, atol=1e-5)
    finally:
        backend.disable()


def test_enabling_dlo_on_a_compiled_block_or_dit_is_refused_naming_the_order() -> None:
    block_compiled = tiny_flux(0).model
    block_compiled.single_transformer_blocks[1].compile()
    with pytest.raises(
        OffloadSetupError, match=r"model\.single_transformer_blocks\.1 was compiled"
    ):
        enable_dlo(block_compiled, device="cpu", use_allgather=False)
    whole_compiled = torch.compile(tiny_flux(0).model)
    with pytest.raises(OffloadSetupError, match="enable DLO on the uncompiled model, then"):
        enable_dlo(whole_compiled, device="cpu", use_allgather=False)


def test_disable_gives_each_block_its_own_compile_and_forward_back() -> None:
    model = tiny_flux(0).model
    block = model.transformer_blocks[0]
    backend = enable_dlo(model, device="cpu", use_allgather=False)
    _compile_repeated(model)
    assert "compile" in vars(block)
    assert "forward" in vars(block)
    backend.disable()
    assert "compile" not in vars(block)
    assert "forward" not in vars(block)
    assert block.compile.__func__ is nn.Module.compile  # type: ignore[attr-defined]


def test_blocks_compiled_with_cuda_graphs_make_each_dit_forward_one_cuda_graph_step() -> None:
    """torch's CUDA graph trees start a step at each outermost compiled call unless told:
    with one graph per block, the next block's graph could reuse the memory of the output
    it reads. DLO marks one step per DiT forward (the graphs themselves run on CUDA only:
    tests/gpu/test_compile_cuda.py), until it is disabled."""
    case = tiny_flux(0)
    backend = enable_dlo(case.model, device="cpu", use_allgather=False)
    try:
        case.model.compile_repeated_blocks(fullgraph=True, mode="reduce-overhead")  # type: ignore[operator]
        before = MarkStepBox.mark_step_counter
        _forwards(case.model, case.inputs, 2)
        assert MarkStepBox.mark_step_counter == before - 2
    finally:
        backend.disable()
    # disable() takes DLO's DiT hooks, the step mark among them, off the model.
    assert not case.model._forward_pre_hooks


def test_compile_metrics_read_what_compile_blocks_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # compile_blocks points inductor at the directory; restore the variable afterwards.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))
    torch._dynamo.reset()  # graphs other tests compiled in this process would be reused
    case = tiny_dit(0)
    compiled = compile_blocks(case.model, CompileMode.DEFAULT, CPU, cache_dir=tmp_path / "graphs")
    metrics.watch_compilation(compiled)
    assert REGISTRY.get_sample_value("dlo_compile_first_forward_seconds") == 0.0
    _forwards(case.model, case.inputs, 2)
    assert compiled.first_forward_seconds is not None
    assert compiled.first_forward_seconds > 0
    assert REGISTRY.get_sample_value("dlo_compiled_blocks") == compiled.blocks > 0
    assert (
        REGISTRY.get_sample_value("dlo_compile_first_forward_seconds")
        == compiled.first_forward_seconds
    )
    assert REGISTRY.get_sample_value("dlo_compile_recompiles") == 0
    assert REGISTRY.get_sample_value("dlo_compile_eager_fallbacks") == 0 == compiled.eager_fallbacks
    lookups = sum(
        REGISTRY.get_sample_value("dlo_compile_cache_lookups", {"result": result}) or 0
        for result in ("hit", "miss")
    )
    assert lookups == compiled.cache_hits + compiled.cache_misses > 0
    assert any((tmp_path / "graphs").iterdir())
