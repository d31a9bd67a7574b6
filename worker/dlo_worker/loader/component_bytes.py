"""The device bytes of each component of a pipeline directory, read from its checkpoint
headers (no weight is read): the input of :mod:`dlo_worker.loader.device_plan`.

A tensor takes the worker's dtype where it is floating (diffusers and transformers cast
floating weights while loading) and its stored size otherwise; with FP8 quantization a
DiT block's matrices take one byte per element (and a float32 scale). Blocks are found
by their keys under the block lists :mod:`dlo_worker.offload.plan` streams: the
registry's lists for a known class, else every top-level list of numbered children.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch

from dlo_worker.loader.checkpoint import (
    TRANSFORMERS_WEIGHTS_NAME,
    WEIGHTS_NAME,
    CheckpointTensor,
    read_checkpoint_index,
)
from dlo_worker.loader.device_plan import ComponentBytes, DeviceBudgetError
from dlo_worker.loader.model_directory import listed_components, read_json_object
from dlo_worker.offload.plan import BLOCK_LISTS_BY_CLASS, TEXT_ENCODER_BLOCK_LISTS

FP8_SCALE_BYTES = 4
_NUMBERED_CHILD = re.compile(r"^([A-Za-z_][\w]*)\.(\d+)\.")


def component_bytes(
    model_dir: Path,
    dtype: torch.dtype,
    *,
    dits: tuple[str, ...],
    fp8_components: tuple[str, ...] = (),
) -> list[ComponentBytes]:
    """Every weighted component of ``model_dir`` (tokenizers and schedulers hold none),
    with the blocks of the ``dits`` and of the text encoders DLO can stream.
    ``fp8_components`` are quantized to FP8 blocks at start."""
    index = read_json_object(model_dir / "model_index.json")
    sizes = []
    for name, (library, class_name) in listed_components(index).items():
        directory = model_dir / name
        weights_name = WEIGHTS_NAME if library == "diffusers" else TRANSFORMERS_WEIGHTS_NAME
        checkpoint = read_checkpoint_index(directory, weights_name)
        if checkpoint is None:
            if (directory / "config.json").is_file():
                raise DeviceBudgetError(
                    f"{directory}: --max-gpu-memory-gib sizes components from safetensors "
                    f"checkpoints, and {name} has none ({weights_name}); convert it to "
                    "safetensors or drop the budget"
                )
            continue
        if name in dits:
            lists = BLOCK_LISTS_BY_CLASS.get(class_name) or _numbered_lists(checkpoint.tensors)
        else:
            lists = TEXT_ENCODER_BLOCK_LISTS.get(class_name, ())
        fp8 = name in fp8_components
        total = 0
        blocks: dict[tuple[str, int], int] = defaultdict(int)
        for key, tensor in checkpoint.tensors.items():
            block = _block_of(key, lists)
            nbytes = _runtime_bytes(tensor, dtype, fp8=fp8 and block is not None)
            total += nbytes
            if block is not None:
                blocks[block] += nbytes
        ordered = sorted(blocks, key=lambda block: (lists.index(block[0]), block[1]))
        sizes.append(ComponentBytes(name, total, tuple(blocks[block] for block in ordered)))
    return sizes


def _runtime_bytes(tensor: CheckpointTensor, dtype: torch.dtype, *, fp8: bool) -> int:
    numel = tensor.numel
    if fp8 and len(tensor.shape) == 2 and tensor.key.endswith(".weight"):
        return numel + FP8_SCALE_BYTES
    itemsize = dtype.itemsize if tensor.dtype.is_floating_point else tensor.dtype.itemsize
    return numel * itemsize


def _block_of(key: str, lists: tuple[str, ...]) -> tuple[str, int] | None:
    for path in lists:
        rest = key.removeprefix(path + ".")
        index, dot, _ = rest.partition(".")
        if rest != key and dot and index.isdigit():
            return path, int(index)
    return None


def _numbered_lists(tensors: dict[str, CheckpointTensor]) -> tuple[str, ...]:
    """Top-level names with numbered children (``blocks.0.``), in first-seen order: the
    keys of the homogeneous ``nn.ModuleList`` children discovery falls back to."""
    found: dict[str, None] = {}
    for key in tensors:
        if match := _NUMBERED_CHILD.match(key):
            found.setdefault(match.group(1))
    return tuple(found)
