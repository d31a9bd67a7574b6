"""The values options take (enumerations) and the frozen model base of every option group."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict


class DType(StrEnum):
    """Weight and compute dtype; ``auto`` is bfloat16 on CUDA and float32 on the CPU."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class SkipLoad(StrEnum):
    """Whether a start whose checkpoint source is recorded in the runtime cache binds the
    DiT to its entry without reading the checkpoint's tensors."""

    OFF = "off"
    PREFERRED = "preferred"
    REQUIRED = "required"
    """A miss is a start-up error (the node was expected to be warm)."""


class Staging(StrEnum):
    """How rank-local DLO packs mapped DiT blocks that are not registered with the driver
    (a checkpoint mapping or a runtime-cache entry) for the copy engine."""

    AUTO = "auto"
    """The ring where this installation built it, else buffers (with one warning)."""
    RING = "ring"
    """The native ring of cache-sized chunks, each copied as soon as it is packed."""
    BUFFERS = "buffers"
    """Block-sized pinned buffers, each packed whole and then copied."""


class Quantization(StrEnum):
    """Online (load-time) weight quantization methods.

    Only per-tensor FP8 has a validated runtime layout that DLO can shard and
    reconstruct with its AllGather; the others are allowed rank-locally only.
    """

    NONE = "none"
    FP8 = "fp8"
    """Per-tensor online FP8 linears: weights and one scale per tensor."""
    FP8_BLOCKWISE = "fp8-blockwise"
    INT8 = "int8"
    NF4 = "nf4"


class CompileMode(StrEnum):
    """``torch.compile``'s mode for ``--compile`` (docs/compile.md says what each costs)."""

    DEFAULT = "default"
    """Inductor's kernels, no CUDA graphs: the shortest compile."""
    MAX_AUTOTUNE_NO_CUDAGRAPHS = "max-autotune-no-cudagraphs"
    """Benchmarks kernel choices (matmul templates) while compiling: a longer first step."""
    REDUCE_OVERHEAD = "reduce-overhead"
    """CUDA graphs over each compiled block: one graph launch per block instead of one per
    kernel; under DLO each block's graph reads its slot's fixed addresses."""

    @property
    def torch_mode(self) -> str | None:
        """The value of ``torch.compile(mode=...)``."""
        return None if self is CompileMode.DEFAULT else self.value


class OffloadPolicy(StrEnum):
    """Which offload strategy is in effect after DLO takes priority."""

    NONE = "none"
    MODEL_CPU_OFFLOAD = "model-cpu-offload"
    LAYERWISE_OFFLOAD = "layerwise-offload"
    DLO = "dlo"


class TransferMode(StrEnum):
    """How DLO moves a block onto the device."""

    NONE = "none"
    """DLO is disabled."""
    RANK_LOCAL = "rank-local"
    """Complete blocks, host-to-device copies only, no DLO collective."""
    ALLGATHER = "allgather"
    """Each rank copies its shard; the group rebuilds the block with all_gather_into_tensor."""


class ShardingGroup(StrEnum):
    """The existing process group DLO shards host weights across."""

    NONE = "none"
    DATA_PARALLEL = "data-parallel"
    SEQUENCE_PARALLEL = "sequence-parallel"


class HostBacking(StrEnum):
    """Where streamed block weights live on the host (chosen by the loader)."""

    ORDINARY = "ordinary"
    CHECKPOINT_MMAP = "checkpoint-mmap"
    RUNTIME_CACHE = "runtime-cache"


class Options(BaseModel):
    """Every option group and derived record: immutable, unknown fields refused."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)


MAX_LORA_SCALE = 10.0
"""The largest magnitude of a LoRA adapter's scale (diffusers' own examples stay within 2)."""
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
"""What an adapter's name may be (``--lora NAME=...``, a request's ``loras[].name``): no
``.``, since diffusers keeps an adapter's layers under module names a ``.`` would split."""
_LORA_NAME = re.compile(LORA_NAME_PATTERN)


@dataclass(frozen=True)
class LoraAdapter:
    """One ``--lora NAME=PATH[:SCALE]``: an adapter loaded at start under ``name``."""

    name: str
    path: Path
    """A LoRA safetensors file, or a directory holding diffusers' LoRA weights file."""
    scale: float = 1.0

    def __str__(self) -> str:
        return f"{self.name}={self.path}:{self.scale:g}"


def parse_lora(text: str) -> LoraAdapter:
    """``NAME=PATH[:SCALE]`` as an adapter; ValueError naming the flag and the fix."""
    name, equals, rest = text.partition("=")
    if not equals or not rest:
        raise ValueError(f"--lora expects NAME=PATH[:SCALE], got {text!r}")
    if not _LORA_NAME.match(name):
        raise ValueError(
            f"--lora {text!r}: the name must be 1-64 letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )
    path, colon, scale_text = rest.rpartition(":")
    try:
        scale = float(scale_text) if colon else 1.0
    except ValueError:
        colon = ""  # a colon inside the path, no scale
    if not colon:
        path, scale = rest, 1.0
    if not path:
        raise ValueError(f"--lora {text!r}: give the adapter's file or directory after '='")
    if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
        raise ValueError(
            f"--lora {text!r}: the scale must be a number from -{MAX_LORA_SCALE:g} to "
            f"{MAX_LORA_SCALE:g}"
        )
    return LoraAdapter(name, Path(path), scale)
