"""Module discovery: registry, homogeneous fallback, config override, and clear failures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from dlo_worker.offload.plan import DiscoveryError, discover
from tests.support.tiny_models import plain_stack, tiny_dit, tiny_flux, tiny_wan


def test_flux_streams_double_then_single_blocks_in_execution_order() -> None:
    plan = discover(tiny_flux(double_blocks=2, single_blocks=3).model)
    (dit,) = plan.dits
    assert dit.block_paths == ("transformer_blocks", "single_transformer_blocks")
    assert [name for name, _ in dit.blocks] == [
        "transformer_blocks.0",
        "transformer_blocks.1",
        "single_transformer_blocks.0",
        "single_transformer_blocks.1",
        "single_transformer_blocks.2",
    ]


def test_wan_streams_blocks() -> None:
    assert discover(tiny_wan(blocks=3).model).dits[0].block_paths == ("blocks",)


def test_dit_keeps_block_zero_embedder_resident() -> None:
    model = tiny_dit(blocks=3).model
    (dit,) = discover(model).dits
    assert dit.resident_modules == (model.transformer_blocks[0].norm1.emb,)


def test_unknown_module_falls_back_to_homogeneous_module_lists() -> None:
    plan = discover(plain_stack(blocks=4).model)
    assert plan.dits[0].block_paths == ("layers",)
    assert plan.block_count == 4


def test_mixed_module_list_is_not_a_block_list() -> None:
    model = nn.Module()
    model.parts = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
    with pytest.raises(DiscoveryError, match="--dlo-block-paths"):
        discover(model)


def test_override_names_the_block_lists() -> None:
    model = tiny_flux().model
    plan = discover(model, ["single_transformer_blocks"])
    assert plan.dits[0].block_paths == ("single_transformer_blocks",)
    assert plan.block_count == 3


@pytest.mark.parametrize(
    ("path", "message"), [("nope", "no module at 'nope'"), ("proj_out", "not an nn.ModuleList")]
)
def test_override_with_a_wrong_path_is_a_clear_error(path: str, message: str) -> None:
    with pytest.raises(DiscoveryError, match=message):
        discover(tiny_flux().model, [path])


def test_pipeline_with_two_dits_plans_both() -> None:
    pipeline = SimpleNamespace(transformer=tiny_dit(0).model, transformer_2=tiny_dit(1).model)
    plan = discover(pipeline)
    assert [dit.name for dit in plan.dits] == ["transformer", "transformer_2"]


def test_pipeline_without_a_dit_is_rejected() -> None:
    with pytest.raises(DiscoveryError, match="has no DiT"):
        discover(SimpleNamespace(vae=nn.Linear(1, 1)))


def test_text_encoders_stream_after_the_dits_with_their_own_block_lists() -> None:
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    t5 = T5EncoderModel(
        T5Config(vocab_size=16, d_model=8, d_ff=16, d_kv=4, num_layers=3, num_heads=2)
    )
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=16,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )
    pipeline = SimpleNamespace(
        transformer=tiny_flux(double_blocks=1, single_blocks=1).model,
        text_encoder=clip,
        text_encoder_2=t5,
    )
    # The DiT's override does not apply to the text encoder.
    plan = discover(pipeline, ["transformer_blocks"], text_encoders=["text_encoder_2"])
    assert [dit.name for dit in plan.dits] == ["transformer", "text_encoder_2"]
    assert [name for name, _ in plan.dits[1].blocks] == [f"encoder.block.{i}" for i in range(3)]
    assert discover(pipeline).block_count == 2
    with pytest.raises(DiscoveryError, match="a CLIPTextModel, whose blocks DLO does not know"):
        discover(pipeline, text_encoders=["text_encoder"])
    with pytest.raises(DiscoveryError, match="'text_encoder_3', which SimpleNamespace does not"):
        discover(pipeline, text_encoders=["text_encoder_3"])
