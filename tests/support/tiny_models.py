"""Tiny DiTs of real diffusers classes (and a plain module) with fixed inputs.

Every builder is deterministic in its seed so separate processes (gloo ranks, the
GPU machine) build identical weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class TinyCase:
    """A model and the keyword inputs of one forward call."""

    model: nn.Module
    inputs: dict[str, Any]

    def forward(self) -> torch.Tensor:
        output = self.model(**self.inputs)
        return output.sample if hasattr(output, "sample") else output


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tiny_flux(
    seed: int = 0, double_blocks: int = 2, single_blocks: int = 3, attention_head_dim: int = 16
) -> TinyCase:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    # The rotary axes split the head dimension (4 + 6 + 6 = 16).
    axes = (attention_head_dim // 4, 3 * attention_head_dim // 8, 3 * attention_head_dim // 8)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=double_blocks,
        num_single_layers=single_blocks,
        attention_head_dim=attention_head_dim,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=axes,
    ).eval()
    g = _generator(seed + 1)
    inputs = {
        "hidden_states": torch.randn(1, 16, 16, generator=g),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
    }
    return TinyCase(model, inputs)


def tiny_dit(seed: int = 0, blocks: int = 3) -> TinyCase:
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(seed)
    model = DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        num_layers=blocks,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
        norm_num_groups=32,
    ).eval()
    g = _generator(seed + 1)
    inputs = {
        "hidden_states": torch.randn(2, 4, 8, 8, generator=g),
        "timestep": torch.tensor([10, 20]),
        "class_labels": torch.tensor([1, 2]),
    }
    return TinyCase(model, inputs)


def tiny_wan(seed: int = 0, blocks: int = 3) -> TinyCase:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=blocks,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()
    g = _generator(seed + 1)
    inputs = {
        "hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 6, 16, generator=g),
    }
    return TinyCase(model, inputs)


class PlainBlock(nn.Module):
    """A residual MLP block mixing two dtypes, with a buffer that stays resident."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width).to(torch.bfloat16)
        self.register_buffer("gain", torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.up(x)).to(torch.bfloat16)
        return x + self.gain * self.down(hidden).float()


class PlainStack(nn.Module):
    """No diffusers class: found by the homogeneous-ModuleList fallback.

    ``skip`` names blocks that forward() does not run (to exercise mispredicted prefetches).
    """

    def __init__(self, blocks: int, width: int = 24) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(PlainBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, 4)
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for index, layer in enumerate(self.layers):
            if index not in self.skip:
                x = layer(x)
        return self.head(x)


def plain_stack(seed: int = 0, blocks: int = 5) -> TinyCase:
    torch.manual_seed(seed)
    model = PlainStack(blocks).eval()
    return TinyCase(model, {"x": torch.randn(3, 8, generator=_generator(seed + 1))})


class InterleavedStack(nn.Module):
    """Two block lists run out of attribute order, as Latte or ConsisID do: the lists
    alternate, and the second one runs in reverse. A parameter-free list of activations
    sits beside them (the fallback must not take it for blocks)."""

    def __init__(self, pairs: int, width: int = 24) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.spatial = nn.ModuleList(PlainBlock(width) for _ in range(pairs))
        self.temporal = nn.ModuleList(PlainBlock(width) for _ in range(pairs))
        self.activations = nn.ModuleList(nn.GELU() for _ in range(pairs))
        self.head = nn.Linear(width, 4)
        self.fail_at: int | None = None
        """A block index whose forward raises (to exercise errors inside blocks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for index, (spatial, temporal) in enumerate(
            zip(self.spatial, reversed(self.temporal), strict=True)
        ):
            x = temporal(self.activations[index](spatial(x)))
            if index == self.fail_at:
                raise RuntimeError(f"block {index} failed")
        return self.head(x)


def interleaved_stack(seed: int = 0, pairs: int = 3) -> TinyCase:
    torch.manual_seed(seed)
    model = InterleavedStack(pairs).eval()
    return TinyCase(model, {"x": torch.randn(3, 8, generator=_generator(seed + 1))})


def tiny_hunyuan_video(seed: int = 0) -> TinyCase:
    """A nested block list (the token refiner's) that runs before the main lists."""
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(seed)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=10,
        num_layers=2,
        num_single_layers=2,
        num_refiner_layers=2,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
    ).eval()
    g = _generator(seed + 1)
    inputs = {
        "hidden_states": torch.randn(1, 4, 1, 4, 4, generator=g),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
        "encoder_attention_mask": torch.ones(1, 5),
        "pooled_projections": torch.randn(1, 8, generator=g),
        "guidance": torch.tensor([3500.0]),
    }
    return TinyCase(model, inputs)


BUILDERS: dict[str, Callable[..., TinyCase]] = {
    "flux": tiny_flux,
    "dit": tiny_dit,
    "wan": tiny_wan,
    "plain": plain_stack,
    "interleaved": interleaved_stack,
    "hunyuan-video": tiny_hunyuan_video,
}
