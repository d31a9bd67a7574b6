"""A component's safetensors checkpoint, described from its headers without reading tensors.

diffusers stores a component either as one ``diffusion_pytorch_model.safetensors`` or
as shards named by ``diffusion_pytorch_model.safetensors.index.json``. The index and
every header are validated here, once, so that corrupt input (a truncated file, a
damaged header, a shard the index names that is missing, a key stored twice) is a
clear :class:`CheckpointError` naming the file and the fix, whichever loading path
follows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dlo_worker.errors import UserFixableError

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
TRANSFORMERS_WEIGHTS_NAME = "model.safetensors"
"""What transformers names a model's checkpoint (text encoders)."""

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


RUNNABLE_FLOAT_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
"""What a floating parameter may be stored as: the loader converts among these exactly
enough to run. Integers, booleans and float8 without a quantization config are not
weights the model can run (they load, converted, as garbage)."""


class CheckpointError(ValueError, UserFixableError):
    """The checkpoint is corrupt or inconsistent; the message names the file and the fix."""


def dtype_problem(stored: torch.dtype, runtime: torch.dtype) -> str | None:
    """Why a tensor stored as ``stored`` cannot load into a runtime tensor of ``runtime``."""
    if runtime.is_floating_point:
        if stored in RUNNABLE_FLOAT_DTYPES:
            return None
        return (
            f"is stored as {_name(stored)}, but a floating parameter loads only from float32, "
            "bfloat16, float16 or float64 (for FP8 streaming use --quantization fp8 on a "
            "bfloat16 checkpoint); the checkpoint is damaged or of another format"
        )
    if stored.is_floating_point or (stored == torch.bool) != (runtime == torch.bool):
        return f"is stored as {_name(stored)} where the model keeps {_name(runtime)}"
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CheckpointTensor:
    """Where one checkpoint key lives and what it holds."""

    key: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * self.numel


@dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor of one component's checkpoint, keyed by checkpoint key."""

    directory: Path
    files: tuple[Path, ...]
    tensors: dict[str, CheckpointTensor]

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors.values())


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def read_checkpoint_index(
    component_dir: Path, weights_name: str = WEIGHTS_NAME
) -> CheckpointIndex | None:
    """The component's safetensors checkpoint (``weights_name``, or the shards its
    ``.index.json`` names), or None when it has none (another format).

    Raises :class:`CheckpointError` for anything corrupt or inconsistent.
    """
    index_path = component_dir / f"{weights_name}.index.json"
    single_path = component_dir / weights_name
    if index_path.is_file():
        expected = _read_index(index_path)
        files = tuple(sorted({component_dir / name for name in expected.values()}))
    elif single_path.is_file():
        expected = None
        files = (single_path,)
    else:
        return None
    tensors: dict[str, CheckpointTensor] = {}
    for file in files:
        for tensor in _read_header(file):
            if tensor.key in tensors:
                raise CheckpointError(
                    f"{tensor.key!r} is stored twice, in {tensors[tensor.key].file.name} and "
                    f"{file.name}; the checkpoint in {component_dir} is inconsistent, rewrite it"
                )
            tensors[tensor.key] = tensor
    if expected is not None:
        _check_index_matches(index_path, expected, tensors)
    return CheckpointIndex(directory=component_dir, files=files, tensors=tensors)


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"{index_path}: unreadable shard index ({type(error).__name__}: {error}); "
            "it needs a 'weight_map' of checkpoint key -> shard file"
        ) from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and "/" not in name and name for name in weight_map.values()
    ):
        raise CheckpointError(
            f"{index_path}: 'weight_map' must map each key to a shard file name in the same "
            "directory"
        )
    for name in sorted(set(weight_map.values())):
        if not (index_path.parent / name).is_file():
            raise CheckpointError(
                f"{index_path}: shard {name} named in the index is missing; copy the complete "
                "checkpoint again"
            )
    return weight_map


def _read_header(file: Path) -> list[CheckpointTensor]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            entries = []
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                view = handle.get_slice(key)
                entries.append((key, view.get_dtype(), tuple(view.get_shape())))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({error}); the file is truncated or "
            "damaged, copy it again"
        ) from None
    tensors = []
    for key, dtype_name, shape in entries:
        if dtype_name not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{file}: {key!r} has unsupported dtype {dtype_name}")
        tensors.append(CheckpointTensor(key, file, SAFETENSORS_DTYPES[dtype_name], shape))
    return tensors


def _check_index_matches(
    index_path: Path, expected: dict[str, str], tensors: dict[str, CheckpointTensor]
) -> None:
    for key, name in expected.items():
        found = tensors.get(key)
        if found is None or found.file.name != name:
            where = f"it is in {found.file.name}" if found else "no shard holds it"
            raise CheckpointError(
                f"{index_path}: the index puts {key!r} in {name} but {where}; the index and "
                "the shards come from different checkpoints"
            )
    unindexed = sorted(set(tensors) - set(expected))
    if unindexed:
        raise CheckpointError(
            f"{index_path}: {len(unindexed)} key(s) in the shards are missing from the index "
            f"(first: {unindexed[0]!r}); the index and the shards come from different checkpoints"
        )
