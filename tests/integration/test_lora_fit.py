"""An adapter is checked against the model's layers before anything of the model changes
(``dlo_worker.pipeline.lora.fit``): one made for wider layers is refused and leaves the
Flux demo bitwise as it was (diffusers would widen its linears to the adapter's shapes for
good), one holding NaN is refused naming a tensor, and an adapter's rank is counted in
every format diffusers converts (XLabs' keys here), on the load route's function and at
start (issue 61, points 1, 3 and 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from safetensors.torch import load_file, save_file

from dlo_worker.config import LoraAdapter
from dlo_worker.pipeline import lora
from tests.support.generate import refused_generate
from tests.support.lora import write_flux_lora

PROMPT = ("--prompt", "a red cat", "--width", "32", "--height", "32")
XLABS_RANK = 64


@pytest.fixture(scope="module")
def pipeline(flux_model_dir: Path) -> FluxPipeline:

    return FluxPipeline.from_pretrained(flux_model_dir)


@pytest.fixture(scope="module")
def adapters(pipeline: FluxPipeline, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``wider``: the demo's adapter with 8 more input columns in every ``lora_A`` (another
    model's shapes); ``xlabs``: a rank-64 adapter in XLabs' keys that fits the demo;
    ``nan``: the demo's adapter, every value NaN."""
    root = tmp_path_factory.mktemp("fit")
    written = write_flux_lora(pipeline.transformer, root / "demo", seed=5)
    weights = load_file(written / "pytorch_lora_weights.safetensors")
    wider = {
        key: torch.cat([value, torch.ones(value.shape[0], 8)], dim=1)
        if ".lora_A." in key
        else value
        for key, value in weights.items()
    }
    save_file(wider, root / "wider.safetensors")
    config = pipeline.transformer.config
    inner = config.num_attention_heads * config.attention_head_dim
    generator = torch.Generator().manual_seed(6)
    xlabs = {
        "double_blocks.0.processor.proj_lora1.down.weight": torch.randn(
            XLABS_RANK, inner, generator=generator
        ),
        "double_blocks.0.processor.proj_lora1.up.weight": torch.randn(
            inner, XLABS_RANK, generator=generator
        ),
    }
    save_file(xlabs, root / "xlabs.safetensors")
    save_file(
        {key: torch.full_like(value, torch.nan) for key, value in weights.items()},
        root / "nan.safetensors",
    )
    return {name: root / f"{name}.safetensors" for name in ("wider", "xlabs", "nan")}


def _weights(pipeline: FluxPipeline) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value.clone()
        for name in ("transformer", "text_encoder", "text_encoder_2")
        for key, value in getattr(pipeline, name).state_dict().items()
    }


def test_an_adapter_for_wider_layers_is_refused_and_the_model_is_unchanged(
    pipeline: FluxPipeline, adapters: dict[str, Path]
) -> None:
    before = _weights(pipeline)
    adapter = LoraAdapter("wider", adapters["wider"])
    with pytest.raises(lora.LoraSetupError) as refused:
        lora.load_adapter(pipeline, adapter, f"lora_path {adapter.path}")
    message = str(refused.value)
    assert message.startswith(f"lora_path {adapter.path}: its transformer.")
    assert "inputs; give an adapter made for this model" in message
    after = _weights(pipeline)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[key], before[key]) for key in before)
    assert not lora.adapted_layers(pipeline, "wider")


def test_the_rank_of_an_xlabs_adapter_is_counted(
    pipeline: FluxPipeline, adapters: dict[str, Path]
) -> None:
    adapter = LoraAdapter("xlabs", adapters["xlabs"])
    label = f"lora_path {adapter.path}"
    with pytest.raises(lora.LoraSetupError, match=f"its rank is {XLABS_RANK}, above"):
        lora.load_adapter(pipeline, adapter, label, max_rank=4)
    assert not lora.adapted_layers(pipeline, "xlabs")
    # Within the limit it loads: the check read XLabs' keys as diffusers converts them.
    lora.load_adapter(pipeline, adapter, label, max_rank=XLABS_RANK)
    try:
        assert lora.adapted_layers(pipeline, "xlabs") == 1
    finally:
        lora.unload_adapter(pipeline, "xlabs")


def test_a_non_finite_adapter_is_refused_naming_a_tensor(
    pipeline: FluxPipeline, adapters: dict[str, Path]
) -> None:
    """Issue 61: an all-NaN adapter loaded (200), then every request naming it answered
    500 ``NonFiniteOutputError``."""
    adapter = LoraAdapter("nan", adapters["nan"])
    with pytest.raises(lora.LoraSetupError, match=r"^lora_path \S+: its transformer\.\S+ holds"):
        lora.load_adapter(pipeline, adapter, f"lora_path {adapter.path}")
    assert not lora.adapted_layers(pipeline, "nan")


REFUSED_AT_START = {
    "wider": ("wider", (), "inputs; give an adapter made for this model"),
    "wider fused": ("wider", ("--fuse-lora", "x"), "inputs; give an adapter made for this model"),
    "nan": ("nan", (), "values that are NaN or infinite; give an adapter with finite weights"),
    "nan fused": (
        "nan",
        ("--fuse-lora", "x"),
        "values that are NaN or infinite; give an adapter with finite weights",
    ),
    "xlabs rank": (
        "xlabs",
        ("--max-lora-rank", "4"),
        f"its rank is {XLABS_RANK}, above --max-lora-rank 4",
    ),
}


@pytest.mark.parametrize("case", REFUSED_AT_START)
def test_generate_refuses_them_in_one_line(
    case: str, flux_model_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Exit 2 naming the flag's value (it was 1 with a traceback for the wider one)."""
    name, flags, message = REFUSED_AT_START[case]
    path = adapters[name]
    stderr = refused_generate(
        flux_model_dir, tmp_path / "x.png", *PROMPT, "--lora", f"x={path}", *flags
    )
    assert f"--lora x={path}:1: its " in stderr
    assert message in stderr
