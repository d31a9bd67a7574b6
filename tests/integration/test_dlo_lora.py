"""LoRA adapters on a DLO pipeline (the Flux demo, CPU): loaded before or after DLO is
enabled, chosen and mixed with ``set_adapters``, bitwise equal to the resident pipeline
with the same adapters; the adapters stay beside the streamed weights (no byte more is
streamed), and fusing them into streamed weights is refused at the call."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from dlo_worker.offload import enable_dlo
from dlo_worker.offload.adapters import adapter_parameters
from dlo_worker.offload.errors import AdapterFusingError
from dlo_worker.pipeline.lora import adapted_layers
from tests.support.lora import ATTENTION_PROJECTIONS, write_flux_lora
from tests.support.tiny_models import tiny_dit, tiny_flux

ADAPTER_SETTINGS: list[tuple[list[str], list[float]]] = [
    (["a"], [1.0]),
    (["a", "b"], [0.7, -0.4]),
    (["b"], [2.0]),
]


def _pipeline(model_dir: Path):  # type: ignore[no-untyped-def]
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(model_dir)


def _image(pipeline) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        return pipeline(
            prompt="a lighthouse at dusk",
            num_inference_steps=2,
            height=64,
            width=64,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images


def _load(pipeline, loras: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    for name, path in loras.items():
        pipeline.load_lora_weights(path, adapter_name=name)


def _images(pipeline) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    images = []
    for names, scales in ADAPTER_SETTINGS:
        pipeline.set_adapters(names, scales)
        images.append(_image(pipeline))
    pipeline.disable_lora()
    images.append(_image(pipeline))
    pipeline.enable_lora()
    return images


@pytest.fixture(scope="module")
def loras(flux_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    transformer = _pipeline(flux_model_dir).transformer
    root = tmp_path_factory.mktemp("loras")
    return {
        name: write_flux_lora(transformer, root / name, seed) for name, seed in (("a", 1), ("b", 2))
    }


@pytest.fixture(scope="module")
def resident(flux_model_dir: Path, loras: dict[str, Path]) -> list[torch.Tensor]:
    pipeline = _pipeline(flux_model_dir)
    _load(pipeline, loras)
    return _images(pipeline)


@pytest.fixture(scope="module")
def bytes_streamed_without_adapters(flux_model_dir: Path) -> int:
    """What DLO streams for as many images as :func:`_images` makes, without adapters."""
    pipeline = _pipeline(flux_model_dir)
    backend = enable_dlo(pipeline, device="cpu", use_allgather=False)
    try:
        for _ in range(len(ADAPTER_SETTINGS) + 1):
            _image(pipeline)
        return backend.stats().bytes_streamed
    finally:
        backend.disable()


@pytest.mark.parametrize("loaded", ["before enable", "after enable"])
def test_adapters_on_streamed_blocks_are_bitwise_equal_to_resident(
    loaded: str,
    flux_model_dir: Path,
    loras: dict[str, Path],
    resident: list[torch.Tensor],
    bytes_streamed_without_adapters: int,
) -> None:
    pipeline = _pipeline(flux_model_dir)
    if loaded == "before enable":
        _load(pipeline, loras)
    backend = enable_dlo(pipeline, device="cpu", use_allgather=False)
    try:
        if loaded == "after enable":
            _load(pipeline, loras)
        streamed = _images(pipeline)
        stats = backend.stats()
    finally:
        backend.disable()
    assert all(torch.equal(a, b) for a, b in zip(resident, streamed, strict=True))
    assert len({image.sum().item() for image in resident}) == len(resident)  # each differs
    # Adapters stay beside the streamed weights: not a byte more is streamed.
    assert stats.bytes_streamed == bytes_streamed_without_adapters


@pytest.mark.parametrize("loaded", ["before enable", "after enable"])
def test_peft_adapters_on_the_class_conditional_dit_are_bitwise_equal_to_resident(
    loaded: str,
) -> None:
    """The DiT demo's transformer has no LoRA loader in diffusers; PEFT injects adapters
    into it directly, and DLO streams it with them as with Flux's."""
    from peft import LoraConfig, inject_adapter_in_model

    def with_adapter(model: torch.nn.Module) -> None:
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules=list(ATTENTION_PROJECTIONS), init_lora_weights=False
        )
        inject_adapter_in_model(config, model, adapter_name="a")
        generator = torch.Generator().manual_seed(5)
        for name, parameter in model.named_parameters():
            if ".lora_" in name:
                with torch.no_grad():
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)

    reference = tiny_dit(0)
    with_adapter(reference.model)
    with torch.inference_mode():
        expected = reference.forward()
        plain = tiny_dit(0).forward()
    case = tiny_dit(0)
    if loaded == "before enable":
        with_adapter(case.model)
    backend = enable_dlo(case.model, device="cpu", use_allgather=False)
    try:
        if loaded == "after enable":
            with_adapter(case.model)
        with torch.inference_mode():
            streamed = case.forward()
    finally:
        backend.disable()
    assert torch.equal(streamed, expected)
    assert not torch.equal(expected, plain)  # the adapter took effect


def test_fusing_into_streamed_weights_is_refused_and_changes_nothing(
    flux_model_dir: Path, loras: dict[str, Path], resident: list[torch.Tensor]
) -> None:
    pipeline = _pipeline(flux_model_dir)
    backend = enable_dlo(pipeline, device="cpu", use_allgather=False)
    try:
        _load(pipeline, loras)
        pipeline.set_adapters(*ADAPTER_SETTINGS[0])
        with pytest.raises(AdapterFusingError, match=r"^fuse_lora\(\) on a DiT whose blocks DLO"):
            pipeline.fuse_lora(adapter_names=["a"])
        with pytest.raises(AdapterFusingError, match=r"^unfuse_lora\(\)"):
            pipeline.transformer.unfuse_lora()
        pipeline.unfuse_lora()  # diffusers unmerges layer by layer: nothing was merged
        assert torch.equal(_image(pipeline), resident[0])
    finally:
        backend.disable()
    assert "fuse_lora" not in vars(pipeline.transformer)  # the DiT's own method is back


def test_adapters_fused_into_the_private_host_copy_stream_the_resident_fused_image(
    flux_model_dir: Path, loras: dict[str, Path], bytes_streamed_without_adapters: int
) -> None:
    """``--fuse-lora``'s fusing (one adapter at a time, merged on the CPU) makes diffusers'
    own ``fuse_lora`` weights; DLO then streams them as any weights, at no extra byte."""
    from dlo_worker.config import LoraAdapter
    from dlo_worker.pipeline.lora import fuse_adapters

    reference = _pipeline(flux_model_dir)
    for name, scale in (("a", 0.8), ("b", -0.6)):
        reference.load_lora_weights(loras[name], adapter_name=name)
        reference.fuse_lora(components=["transformer"], lora_scale=scale, adapter_names=[name])
        reference.unload_lora_weights()
    unfused = _image(_pipeline(flux_model_dir))
    fused_resident = _image(reference)

    pipeline = _pipeline(flux_model_dir)
    fuse_adapters(pipeline, [LoraAdapter("a", loras["a"], 0.8), LoraAdapter("b", loras["b"], -0.6)])
    reference_state = reference.transformer.state_dict()
    assert all(
        torch.equal(tensor, reference_state[name])
        for name, tensor in pipeline.transformer.state_dict().items()
    )
    assert adapted_layers(pipeline, "a") == adapted_layers(pipeline, "b") == 0
    backend = enable_dlo(pipeline, device="cpu", use_allgather=False)
    try:
        streamed = [_image(pipeline) for _ in range(len(ADAPTER_SETTINGS) + 1)]
        stats = backend.stats()
    finally:
        backend.disable()
    assert all(torch.equal(image, fused_resident) for image in streamed)
    assert not torch.equal(fused_resident, unfused)  # the adapters took effect
    assert stats.bytes_streamed == bytes_streamed_without_adapters


def test_streamed_weights_keep_their_shape_and_show_empty_in_the_state_dict() -> None:
    case = tiny_flux(0)
    shapes = {name: p.shape for name, p in case.model.named_parameters()}
    backend = enable_dlo(case.model, device="cpu", use_allgather=False)
    try:
        state = case.model.state_dict()
        assert {name: p.shape for name, p in case.model.named_parameters()} == shapes
    finally:
        backend.disable()
    streamed = [name for name in state if name.startswith(("transformer_blocks.", "single_"))]
    assert streamed
    assert all(state[name].numel() == 0 for name in streamed)
    assert state["x_embedder.weight"].shape == shapes["x_embedder.weight"]
    # Disabled, the streamed weights are empty: the model cannot run on placeholders.
    assert all(p.numel() == 0 for name, p in case.model.named_parameters() if name in set(streamed))


def _bytes(parameters: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in parameters)


def test_adapters_count_in_the_gpu_memory_budget() -> None:
    """A budget that holds every block when adapters are ignored cannot once they count."""
    from peft import LoraConfig

    case = tiny_flux(0)
    model = case.model
    config = LoraConfig(r=16, lora_alpha=16, target_modules=list(ATTENTION_PROJECTIONS))
    model.add_adapter(config, adapter_name="a")  # type: ignore[operator]
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]  # type: ignore[misc]
    adapter = {id(p) for block in blocks for p in adapter_parameters(block)}
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    base = [_bytes(p for p in block.parameters() if id(p) not in adapter) for block in blocks]
    non_block = _bytes(p for p in model.parameters() if id(p) not in in_blocks)
    non_block += _bytes(model.buffers())
    adapter_bytes = _bytes(p for p in model.parameters() if id(p) in adapter)
    assert adapter_bytes > min(base)  # the adapters need the room of a block
    everything = non_block + 2 * max(base) + sum(base)

    def resident_blocks(budget: int) -> int:
        fresh = copy.deepcopy(model)
        backend = enable_dlo(
            fresh, device="cpu", use_allgather=False, gpu_memory_budget_gib=budget / 2**30
        )
        try:
            return backend.stats().resident_blocks
        finally:
            backend.disable()

    assert resident_blocks(everything) < len(blocks)
    assert resident_blocks(everything + adapter_bytes) == len(blocks)


def test_the_worker_counts_adapters_it_loads_after_enable_from_their_files(
    loras: dict[str, Path],
) -> None:
    from safetensors.torch import load_file

    from dlo_worker.config import LoraAdapter
    from dlo_worker.pipeline.lora import device_bytes

    file = loras["b"] / "pytorch_lora_weights.safetensors"
    numel = sum(t.numel() for t in load_file(file).values())
    adapters = [LoraAdapter("a", loras["a"]), LoraAdapter("b", file, 0.5)]
    assert device_bytes(adapters, torch.bfloat16) == 2 * 2 * numel  # same shapes, 2 bytes
