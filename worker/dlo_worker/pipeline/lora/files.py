"""What an adapter's file says before anything loads: that it exists, the device bytes it
takes, and its content digest (reading headers only)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from dlo_worker.config import LoraAdapter
from dlo_worker.pipeline.lora.errors import LoraSetupError
from dlo_worker.runtime_cache.digest import file_sha256


def check_files(adapters: Sequence[LoraAdapter]) -> None:
    """Before anything loads: every adapter's file or directory exists."""
    for adapter in adapters:
        if not adapter.path.exists():
            raise LoraSetupError(
                f"--lora {adapter}: {adapter.path} does not exist; give a LoRA safetensors "
                "file or a directory holding one"
            )


def device_bytes(adapters: Sequence[LoraAdapter], dtype: torch.dtype) -> int:
    """Device bytes the adapters take once loaded in ``dtype``: every tensor of their
    files, read from the headers (a text-encoder part included, so never less)."""
    numel = sum(
        math.prod(shape)
        for adapter in adapters
        for shape in _shapes(adapter, f"--lora {adapter}").values()
    )
    return numel * dtype.itemsize


def fusion_identity(adapters: Sequence[LoraAdapter]) -> tuple[str, ...]:
    """What ``--fuse-lora`` adds to the weights, in fusing order: each adapter file's
    SHA-256 and its scale (not its name or path, which do not change a byte). The runtime
    cache keys entries built from fused weights by it."""
    return tuple(
        f"sha256:{file_sha256(weights_file(adapter))}*{adapter.scale!r}" for adapter in adapters
    )


def _shapes(adapter: LoraAdapter, label: str) -> dict[str, list[int]]:
    """Every tensor's shape in the adapter's file, from its header."""
    path = weights_file(adapter, label)
    try:
        with safe_open(str(path), framework="pt") as weights:
            return {
                key: list(weights.get_slice(key).get_shape())
                for key in weights.keys()  # noqa: SIM118 (a safe_open handle, not a dict)
            }
    except Exception as error:  # a header that does not parse is this file's problem
        raise LoraSetupError(
            f"{label}: cannot load it ({type(error).__name__}: {error}); give a LoRA "
            "safetensors file"
        ) from error


def weights_file(adapter: LoraAdapter, label: str | None = None) -> Path:
    """The adapter's safetensors file: the path itself, or the one its directory holds
    (diffusers' ``pytorch_lora_weights.safetensors`` first); refusals start with ``label``
    (``--lora NAME=PATH`` by default)."""
    if adapter.path.is_file():
        return adapter.path
    default = adapter.path / "pytorch_lora_weights.safetensors"
    candidates = [default] if default.is_file() else sorted(adapter.path.glob("*.safetensors"))
    if len(candidates) != 1:
        raise LoraSetupError(
            f"{label or f'--lora {adapter}'}: {adapter.path} holds {len(candidates)} "
            "safetensors files; give the adapter's file itself"
        )
    return candidates[0]
