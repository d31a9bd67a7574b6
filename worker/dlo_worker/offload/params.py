"""Walking a model's modules and moving or repointing its tensors (no backend state).

Streamed blocks are skipped wherever the rest of the model is moved to the device: their
parameters go to host memory and are repointed into a slot only while they run.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from dlo_worker.offload.block import StreamedBlock
from dlo_worker.offload.host_weights import HostWeightsError

logger = logging.getLogger(__name__)


def release_freed_host_memory() -> None:
    """Return freed host tensors to the OS now rather than at some later malloc."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        logger.debug("malloc_trim unavailable; freed memory stays with the allocator")


def parameter_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of distinct tensors (meta tensors count by shape: nothing is allocated)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None:
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def set_parameter_data(parameter: nn.Parameter, value: torch.Tensor) -> None:
    """``parameter.data = value``, also for the meta parameters of a DiT bound to host
    weights (whose tensor type cannot change in place); the Parameter object stays the
    same either way."""
    if parameter.is_meta:
        torch.utils.swap_tensors(parameter, nn.Parameter(value, parameter.requires_grad))
    else:
        parameter.data = value


def assign_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Point parameter or buffer ``name`` of ``module`` at ``value`` (same Parameter object)."""
    owner_path, _, attribute = name.rpartition(".")
    owner = module.get_submodule(owner_path)
    parameter = owner._parameters.get(attribute)
    if parameter is not None:
        set_parameter_data(parameter, value)
    elif attribute in owner._buffers:
        owner._buffers[attribute] = value
    else:
        raise HostWeightsError(f"{name} is neither a parameter nor a buffer of the model")


def modules_of(model_or_pipeline: object) -> list[nn.Module]:
    """The module itself, or every module component of a diffusers pipeline."""
    if isinstance(model_or_pipeline, nn.Module):
        return [model_or_pipeline]
    components = getattr(model_or_pipeline, "components", {})
    return [module for module in components.values() if isinstance(module, nn.Module)]


def move_module_except(module: nn.Module, skipped_ids: set[int], device: torch.device) -> None:
    """Move every parameter and buffer of ``module`` to ``device``, except the parameters
    inside skipped blocks (their buffers move: they are small and never streamed)."""
    for submodule in walk_except(module, skipped_ids):
        for parameter in submodule.parameters(recurse=False):
            if parameter.device != device:
                parameter.data = parameter.data.to(device)
        _move_buffers(submodule, device)
    for skipped in (sub for sub in module.modules() if id(sub) in skipped_ids):
        for submodule in skipped.modules():
            _move_buffers(submodule, device)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for name, buffer in list(module.named_buffers(recurse=False)):
        if buffer is not None and buffer.device != device:
            module._buffers[name] = buffer.to(device)


def walk_except(module: nn.Module, skipped_ids: set[int]) -> Iterator[nn.Module]:
    """``module`` and its descendants, not entering the modules whose ids are skipped."""
    if id(module) in skipped_ids:
        return
    yield module
    for child in module.children():
        yield from walk_except(child, skipped_ids)


def pack_block(block: StreamedBlock, dtype: torch.dtype, target: torch.Tensor) -> None:
    """Write the block's ``dtype`` tensors at their layout offsets; zero the gaps."""
    end = 0
    for parameter, parameter_dtype, offset, numel, *_ in block.parameters:
        if parameter_dtype != dtype:
            continue
        target[end:offset].zero_()
        target[offset : offset + numel].copy_(parameter.detach().reshape(-1))
        end = offset + numel
    target[end:].zero_()
