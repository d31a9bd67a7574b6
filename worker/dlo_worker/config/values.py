"""The values options take (enumerations) and the frozen model base of every option group."""

from __future__ import annotations

from enum import StrEnum

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
