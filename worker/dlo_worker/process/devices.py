"""Resolve the configuration's ``auto`` device and dtype against what this machine has."""

from __future__ import annotations

import os

import torch

from dlo_worker.config import DType, ModelOptions
from dlo_worker.errors import UserFixableError

_TORCH_DTYPES = {
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
    DType.FLOAT32: torch.float32,
}


class DeviceUnavailableError(RuntimeError, UserFixableError):
    """The configured device does not exist on this machine."""


def resolve_device(options: ModelOptions) -> torch.device:
    """``auto`` is CUDA when there is a GPU, else the CPU.

    An unindexed ``cuda`` under a launcher means this process's ``$LOCAL_RANK`` GPU.
    """
    if options.device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        device = torch.device("cuda")
    else:
        device = torch.device(options.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"--device {options.device}: no CUDA device is available; use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"--device {options.device}: only {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def resolve_dtype(options: ModelOptions, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 on the CPU (where bfloat16 matmuls are slow)."""
    if options.dtype == DType.AUTO:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _TORCH_DTYPES[options.dtype]
