"""Whether an adapter fits the model, decided before anything of the model changes.

diffusers converts every format it knows (Kohya, XLabs, ai-toolkit, BFL's and others) into
its own names with ``lora_state_dict``, a class method that touches no model. Each of the
converted down (``lora_A``) and up (``lora_B``) matrices must then name a layer of the
pipeline and match its input and output features, and hold no NaN or infinity; its rank
(the rows of ``lora_A``) must be within ``--max-lora-rank``. Left to
``load_lora_weights``, an adapter made for wider layers makes diffusers widen a Flux
transformer's linears to its shapes (what it does for Flux Control adapters), for good:
every later image fails, with or without adapters. Checked here, such an adapter is
refused and the model stays bitwise as it was.

The check reads the layers' declared features only, so it also runs on the pipeline's
meta skeleton before any weight is read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from dlo_worker.config import LoraAdapter
from dlo_worker.pipeline.lora.errors import LoraSetupError
from dlo_worker.pipeline.lora.files import weights_file

_MATRIX = re.compile(
    r"^(?P<component>[^.]+)\.(?P<layer>.+)\.lora_(?P<side>[AB])(\.[^.]+)?\.weight$"
)
"""A converted key: ``transformer.transformer_blocks.0.attn.to_q.lora_A.weight`` (PEFT may
put an adapter name before ``weight``)."""


def cannot_load(label: str, pipeline: object, error: Exception) -> LoraSetupError:
    """The refusal of an adapter file the loader (or its conversion) raised on."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return LoraSetupError(
        f"{label}: cannot load it ({type(error).__name__}: {first_line[:300]}); give a "
        f"LoRA safetensors file made for {type(pipeline).__name__}"
    )


def converted_weights(
    pipeline: object, adapter: LoraAdapter, label: str
) -> dict[str, torch.Tensor]:
    """The adapter's tensors in diffusers' names, as ``load_lora_weights`` would load them
    (its pipeline class's ``lora_state_dict``; the model is not touched)."""
    convert = getattr(type(pipeline), "lora_state_dict", None)
    if convert is None:
        raise LoraSetupError(
            f"{label}: {type(pipeline).__name__} has no LoRA loader in diffusers; drop it"
        )
    try:
        converted = convert(str(weights_file(adapter, label)))
    except LoraSetupError:
        raise
    except Exception as error:  # any conversion failure is this file's problem
        raise cannot_load(label, pipeline, error) from error
    # Some mixins answer (state dict, network alphas).
    state = converted[0] if isinstance(converted, tuple) else converted
    return {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}


def check_fit(
    pipeline: object, adapter: LoraAdapter, label: str, max_rank: int | None = None
) -> None:
    """Refuse, naming ``label``, an adapter whose matrices name no layer of the pipeline,
    do not match their layer's features, hold NaN or infinity, or exceed ``max_rank``
    (None: no limit)."""
    weights = converted_weights(pipeline, adapter, label)
    check_layers(pipeline, weights, label)
    check_finite(weights, label)
    if max_rank is not None:
        rank = rank_of(weights)
        if rank > max_rank:
            raise LoraSetupError(
                f"{label}: its rank is {rank}, above --max-lora-rank {max_rank}; give an "
                "adapter of a lower rank, or raise the limit"
            )


def check_finite(weights: Mapping[str, torch.Tensor], label: str) -> None:
    """No NaN or infinity in the adapter: it would make every image it applies to
    non-finite (the worker's rule for weights: refused before ready, naming the tensor)."""
    for key, tensor in weights.items():
        if tensor.is_floating_point():
            bad = int(tensor.numel() - torch.isfinite(tensor).sum())
            if bad:
                raise LoraSetupError(
                    f"{label}: its {key} holds {bad} of {tensor.numel()} values that are "
                    "NaN or infinite; give an adapter with finite weights"
                )


def rank_of(weights: Mapping[str, torch.Tensor]) -> int:
    """The largest rank of converted adapter weights: the rows of their ``lora_A``."""
    return max(
        (
            int(tensor.shape[0])
            for key, tensor in weights.items()
            if (match := _MATRIX.match(key)) and match["side"] == "A"
        ),
        default=0,
    )


def check_layers(pipeline: object, weights: Mapping[str, torch.Tensor], label: str) -> None:
    """Every converted matrix names a layer of the pipeline and fits its features."""
    pipeline_name = type(pipeline).__name__
    missing: list[str] = []
    for key, tensor in weights.items():
        match = _MATRIX.match(key)
        if match is None:
            continue
        layer = _layer(pipeline, match["component"], match["layer"])
        if layer is None:
            missing.append(key)
            continue
        features = _features(layer)
        if features is None:
            continue
        inputs, outputs = features
        side, shape = match["side"], tuple(tensor.shape)
        expected = inputs if side == "A" else outputs
        actual = shape[1] if side == "A" and len(shape) > 1 else shape[0]
        if actual != expected:
            what = "inputs" if side == "A" else "outputs"
            raise LoraSetupError(
                f"{label}: its {key} has shape {list(shape)}, but {pipeline_name}'s "
                f"{match['component']}.{match['layer']} has {expected} {what}; give an "
                "adapter made for this model"
            )
    if missing:
        raise LoraSetupError(
            f"{label}: {pipeline_name} has no layer for {len(missing)} of its weights "
            f"(e.g. {missing[0]}); give an adapter made for this model"
        )


def _layer(pipeline: object, component_name: str, path: str) -> nn.Module | None:
    component = getattr(pipeline, component_name, None)
    if not isinstance(component, nn.Module):
        return None
    try:
        return component.get_submodule(path)
    except AttributeError:
        return None


def _features(layer: nn.Module) -> tuple[int, int] | None:
    """A layer's input and output features (of the base layer where PEFT wraps it)."""
    base = getattr(layer, "base_layer", layer)
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    if isinstance(base, nn.Conv2d):
        return base.in_channels, base.out_channels
    return None


def check_adapters(
    pipeline: object,
    fused: Sequence[LoraAdapter],
    switchable: Sequence[LoraAdapter],
    max_rank: int | None,
) -> None:
    """``--lora`` at start, on the pipeline's meta skeleton before any weight is read:
    every adapter fits the model, and those kept beside the weights (not fused, which
    costs nothing per step) are within ``max_rank``. A pipeline without a LoRA loader is
    left to the loader's own refusal."""
    if getattr(pipeline, "load_lora_weights", None) is None:
        return
    for adapter in fused:
        check_fit(pipeline, adapter, f"--lora {adapter}")
    for adapter in switchable:
        check_fit(pipeline, adapter, f"--lora {adapter}", max_rank)
