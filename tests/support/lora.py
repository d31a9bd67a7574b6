"""LoRA adapters written as users get them: random PEFT adapters saved in diffusers' LoRA
format (``FluxPipeline.save_lora_weights``), deterministic in their seed."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")


def write_flux_lora(transformer: nn.Module, directory: Path, seed: int, rank: int = 4) -> Path:
    """A rank-``rank`` adapter on ``transformer``'s attention projections, every matrix
    random (a trained adapter's B is not zero), saved under ``directory``."""
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = copy.deepcopy(transformer)
    config = LoraConfig(
        r=rank, lora_alpha=rank, target_modules=list(ATTENTION_PROJECTIONS), init_lora_weights=False
    )
    model.add_adapter(config, adapter_name="written")  # type: ignore[operator]
    generator = torch.Generator().manual_seed(seed)
    layers = {
        name: torch.randn(tensor.shape, generator=generator) * 0.1
        for name, tensor in get_peft_model_state_dict(model, adapter_name="written").items()
    }
    FluxPipeline.save_lora_weights(directory, transformer_lora_layers=layers)
    return directory
