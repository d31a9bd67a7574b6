"""The worker configuration: every option, its default, and every rule that combines them.

This module is the configuration plane of the DLO design and the only place option
combinations are validated. It imports no torch, so the operator can validate a
DiffusionDeployment with the worker's own rules before it creates anything.

Field names are the design doc's names; each field maps one-to-one onto a CLI flag
(``--`` + the name with dashes, see :func:`flag_for`). Rule messages name the flags
involved and say how to fix the combination.
"""

from __future__ import annotations

import math
import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dlo_worker.errors import UserFixableError


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


DEFAULT_RUNTIME_CACHE_LOCK_TIMEOUT_S = 600.0
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")

# Flags whose spelling is not simply "--" + the field name with dashes.
NEGATIVE_FLAGS = {"dlo_use_allgather": "--dlo-no-use-allgather"}


def flag_for(field_name: str) -> str:
    """The CLI flag of a configuration field (the one-to-one mapping the CLI is built from)."""
    return "--" + field_name.replace("_", "-")


def _finite(value: float, field_name: str) -> float:
    if not math.isfinite(value):
        raise ValueError(
            f"{flag_for(field_name)} must be a finite number, got {value!r}; give a plain number"
        )
    return value


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)


class ModelOptions(_Options):
    """What to load and where to run it."""

    model: Path | None = Field(
        default=None, description="Diffusers-format pipeline directory (model_index.json)."
    )
    dtype: DType = Field(default=DType.AUTO, description="Weight and compute dtype.")
    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N.")
    quantization: Quantization = Field(
        default=Quantization.NONE, description="Online weight quantization method."
    )

    @field_validator("device")
    @classmethod
    def _device_is_known(cls, value: str) -> str:
        if not _DEVICE_PATTERN.match(value):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value


class ParallelOptions(_Options):
    """Parallel sizes of one engine; the world size is their product."""

    data_parallel_size: Annotated[int, Field(ge=1)] = Field(
        default=1, description="Independent request lanes (DP ranks)."
    )
    sequence_parallel_size: Annotated[int, Field(ge=1)] = Field(
        default=1, description="Ranks sharing one sequence (SP)."
    )
    tensor_parallel_size: Annotated[int, Field(ge=1)] = Field(
        default=1, description="Ranks sharing each layer's weights (TP)."
    )
    use_hsdp: bool = Field(default=False, description="Shard DiT parameters with HSDP.")
    hsdp_shard_size: int = Field(
        default=-1, description="HSDP shard group size; -1 = world size / replicate size."
    )
    hsdp_replicate_size: Annotated[int, Field(ge=1)] = Field(
        default=1, description="HSDP replica count."
    )

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.sequence_parallel_size * self.tensor_parallel_size

    @field_validator("hsdp_shard_size")
    @classmethod
    def _shard_size_in_range(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"--hsdp-shard-size must be -1 (auto) or >= 1, got {value}")
        return value

    @property
    def effective_hsdp_shard_size(self) -> int:
        """The HSDP shard group size with ``-1`` resolved against the world size."""
        if self.hsdp_shard_size == -1:
            return self.world_size // self.hsdp_replicate_size
        return self.hsdp_shard_size


class OffloadOptions(_Options):
    """Offload strategy and the DLO options, under the design doc's names."""

    enable_cpu_offload: bool = Field(
        default=False, description="Model-level CPU offload (a whole component at a time)."
    )
    enable_layerwise_offload: bool = Field(
        default=False, description="Standard single-process layerwise CPU offload."
    )
    enable_distributed_layerwise_offload: bool = Field(
        default=False, description="Stream DiT blocks from host memory through two device slots."
    )
    dlo_use_allgather: bool = Field(
        default=True,
        description="Shard host weights across the DP (else SP) group and rebuild each block "
        "with an AllGather; --dlo-no-use-allgather streams complete rank-local blocks.",
    )
    dlo_resident_layers: Annotated[int, Field(ge=0)] = Field(
        default=0,
        description="Blocks of each DiT kept resident on the device, spread evenly through "
        "it so streamed copies overlap resident compute (no-AllGather only).",
    )
    dlo_gpu_memory_budget_gib: float | None = Field(
        default=None,
        description="Device memory (GiB) for the DiT's weights under DLO: non-block weights, "
        "the two slots, and as many resident blocks as fit (chosen so the streamed "
        "bytes spread evenly through the forward); leave the rest "
        "of the GPU for activations and the other components (no-AllGather only).",
    )
    dlo_allgather_shard_buffers: Annotated[int, Field(ge=2, le=64)] = Field(
        default=4,
        description="DLO AllGather: device buffers for this rank's block shards (each the "
        "largest block / group size); shards are copied up to this many blocks before "
        "their gather, so blocks whose copies outlast their compute borrow time from "
        "those whose compute outlasts theirs. 2 uses the least GPU memory.",
    )
    dlo_enable_runtime_cache: bool = Field(
        default=False,
        description="Publish or join a node-local mmap cache of the final DiT tensors "
        "(no-AllGather only).",
    )
    dlo_runtime_cache_root: Path | None = Field(
        default=None,
        description="Runtime-cache directory (absolute); default "
        "$XDG_CACHE_HOME/dlo-worker/runtime-cache.",
    )
    dlo_runtime_cache_lock_timeout: float = Field(
        default=DEFAULT_RUNTIME_CACHE_LOCK_TIMEOUT_S,
        description="Seconds to wait for another process publishing the same cache entry.",
    )
    dlo_runtime_cache_skip_load: SkipLoad = Field(
        default=SkipLoad.PREFERRED,
        description="Skip loading the DiT's checkpoint when its source is recorded in the "
        "runtime cache: off, preferred (a miss loads ordinarily), required (a miss is an error).",
    )
    dlo_runtime_cache_size_budget_gib: float | None = Field(
        default=None,
        description="Upper bound (GiB) of the runtime-cache entries on the node; publishing "
        "beyond it evicts the least recently used entries no process maps. Default: unbounded.",
    )
    dlo_runtime_cache_pin_limit_gib: float = Field(
        default=0.0,
        description="Host-registration budget (GiB) per worker for direct H2D from the "
        "mapped weights (a runtime-cache entry, or a checkpoint that matches the model "
        "without adapters), rank-local DLO on CUDA; 0 keeps bounded staging.",
    )

    dlo_block_paths: tuple[str, ...] | None = Field(
        default=None,
        description="Comma-separated attribute paths of the DiT's block lists in execution "
        "order (e.g. transformer_blocks,single_transformer_blocks); default: discovered.",
    )

    @field_validator("dlo_block_paths", mode="before")
    @classmethod
    def _split_block_paths(cls, value: object) -> object:
        if isinstance(value, str):
            value = tuple(part.strip() for part in value.split(",") if part.strip())
        if value is not None and not value:
            raise ValueError("--dlo-block-paths needs at least one attribute path")
        return value

    @field_validator("dlo_runtime_cache_lock_timeout")
    @classmethod
    def _lock_timeout_positive(cls, value: float) -> float:
        _finite(value, "dlo_runtime_cache_lock_timeout")
        if value <= 0:
            raise ValueError(f"--dlo-runtime-cache-lock-timeout must be > 0 seconds, got {value!r}")
        return value

    @field_validator("dlo_gpu_memory_budget_gib")
    @classmethod
    def _budget_positive(cls, value: float | None) -> float | None:
        if value is None:
            return value
        _finite(value, "dlo_gpu_memory_budget_gib")
        if value <= 0:
            raise ValueError(f"--dlo-gpu-memory-budget-gib must be > 0 GiB, got {value!r}")
        return value

    @field_validator("dlo_runtime_cache_size_budget_gib")
    @classmethod
    def _size_budget_positive(cls, value: float | None) -> float | None:
        if value is None:
            return value
        _finite(value, "dlo_runtime_cache_size_budget_gib")
        if value <= 0:
            raise ValueError(
                f"--dlo-runtime-cache-size-budget-gib must be > 0 GiB, got {value!r}; leave it "
                "unset for an unbounded cache"
            )
        return value

    @field_validator("dlo_runtime_cache_pin_limit_gib")
    @classmethod
    def _pin_limit_non_negative(cls, value: float) -> float:
        _finite(value, "dlo_runtime_cache_pin_limit_gib")
        if value < 0:
            raise ValueError(
                f"--dlo-runtime-cache-pin-limit-gib must be >= 0 GiB, got {value!r}; "
                "use 0 to keep bounded staging"
            )
        return value

    @field_validator("dlo_runtime_cache_root")
    @classmethod
    def _cache_root_absolute(cls, value: Path | None) -> Path | None:
        if value is not None and (not value.is_absolute() or ".." in value.parts):
            raise ValueError(
                f"--dlo-runtime-cache-root must be an absolute path without '..' so every "
                f"process on the node resolves the same entry, got {str(value)!r}"
            )
        return value


class WorkerConfig(_Options):
    """The whole worker configuration, validated against the DLO compatibility matrix."""

    model: ModelOptions = ModelOptions()
    parallel: ParallelOptions = ParallelOptions()
    offload: OffloadOptions = OffloadOptions()

    @model_validator(mode="after")
    def _combinations_are_supported(self) -> WorkerConfig:
        problems = combination_errors(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def effective(self) -> EffectiveConfig:
        """The decisions the rest of the worker acts on (pure; see :func:`resolve`)."""
        return resolve(self)


def combination_errors(config: WorkerConfig) -> list[str]:
    """Every violated compatibility rule, each naming the options involved and the fix."""
    parallel, offload, quantization = config.parallel, config.offload, config.model.quantization
    errors = _hsdp_errors(parallel)
    if not offload.enable_distributed_layerwise_offload:
        errors += _dlo_options_without_dlo(offload)
        if offload.enable_cpu_offload and offload.enable_layerwise_offload:
            errors.append(
                "--enable-cpu-offload and --enable-layerwise-offload are alternatives; "
                "choose one (or use --enable-distributed-layerwise-offload)"
            )
        return errors

    if offload.dlo_use_allgather:
        errors += _allgather_errors(config)
    _, sharding_size = dlo_sharding_group(parallel, offload.dlo_use_allgather)
    if sharding_size == 1 and (
        offload.dlo_allgather_shard_buffers != OffloadOptions().dlo_allgather_shard_buffers
    ):
        errors.append(
            "--dlo-allgather-shard-buffers applies only to DLO AllGather over a DP or SP "
            "group of more than one rank (rank-local DLO copies whole blocks into its two "
            "slots); drop it, or use --dlo-use-allgather with --data-parallel-size or "
            "--sequence-parallel-size > 1"
        )
    if offload.dlo_resident_layers > 0 and offload.dlo_gpu_memory_budget_gib is not None:
        errors.append(
            "--dlo-resident-layers and --dlo-gpu-memory-budget-gib both choose the resident "
            "blocks; set one of them"
        )
    if offload.dlo_enable_runtime_cache:
        if quantization != Quantization.NONE:
            errors.append(
                f"--dlo-enable-runtime-cache rejects --quantization {quantization}: cache "
                "entries hold unquantized final tensors; use --quantization none or drop "
                "the runtime cache"
            )
        if parallel.use_hsdp:
            errors.append(
                "--dlo-enable-runtime-cache rejects --use-hsdp: HSDP/DTensor layouts cannot "
                "be cached; drop one of them"
            )
    if offload.dlo_runtime_cache_skip_load != SkipLoad.PREFERRED and not (
        offload.dlo_enable_runtime_cache
    ):
        errors.append(
            "--dlo-runtime-cache-skip-load requires --dlo-enable-runtime-cache: it binds to "
            "runtime-cache entries; add --dlo-enable-runtime-cache or drop it"
        )
    if offload.dlo_runtime_cache_size_budget_gib is not None and not (
        offload.dlo_enable_runtime_cache
    ):
        errors.append(
            "--dlo-runtime-cache-size-budget-gib requires --dlo-enable-runtime-cache: it bounds "
            "the runtime cache; add --dlo-enable-runtime-cache or drop it"
        )
    if offload.dlo_runtime_cache_pin_limit_gib > 0 and sharding_size > 1:
        errors.append(
            "--dlo-runtime-cache-pin-limit-gib > 0 registers the mapped weights of rank-local "
            "DLO, but with DLO AllGather each rank's shard already sits in private pinned "
            "memory; add --dlo-no-use-allgather or set it to 0"
        )
    return errors


def _allgather_errors(config: WorkerConfig) -> list[str]:
    """Options that cannot run with DLO AllGather (sharded host weights)."""
    parallel, offload, quantization = config.parallel, config.offload, config.model.quantization
    errors: list[str] = []
    if parallel.use_hsdp:
        errors.append(
            "--use-hsdp cannot be combined with DLO AllGather: HSDP already shards the "
            "parameters and DLO would shard them twice; add --dlo-no-use-allgather"
        )
    if quantization not in (Quantization.NONE, Quantization.FP8):
        errors.append(
            f"--quantization {quantization} cannot be combined with DLO AllGather: only "
            "per-tensor fp8 has a validated shard layout; add --dlo-no-use-allgather or "
            "use --quantization fp8 or none"
        )
    if offload.dlo_resident_layers > 0:
        errors.append(
            "--dlo-resident-layers requires --dlo-no-use-allgather: AllGather ranks stream "
            "every block in lockstep; add --dlo-no-use-allgather or set it to 0"
        )
    if offload.dlo_gpu_memory_budget_gib is not None:
        errors.append(
            "--dlo-gpu-memory-budget-gib requires --dlo-no-use-allgather: it keeps blocks "
            "resident, and AllGather ranks stream every block in lockstep; add "
            "--dlo-no-use-allgather or drop it"
        )
    if offload.dlo_enable_runtime_cache:
        errors.append(
            "--dlo-enable-runtime-cache requires --dlo-no-use-allgather: the runtime cache "
            "backs complete rank-local blocks; add --dlo-no-use-allgather"
        )
    return errors


def _hsdp_errors(parallel: ParallelOptions) -> list[str]:
    if not parallel.use_hsdp:
        if parallel.hsdp_shard_size != -1 or parallel.hsdp_replicate_size != 1:
            return ["--hsdp-shard-size and --hsdp-replicate-size require --use-hsdp; add it"]
        return []
    if parallel.data_parallel_size > 1 or parallel.tensor_parallel_size > 1:
        return [
            "--use-hsdp cannot be combined with --data-parallel-size > 1 or "
            "--tensor-parallel-size > 1: HSDP only composes with sequence parallelism; "
            "set both to 1 or drop --use-hsdp"
        ]
    world = parallel.world_size
    if world % parallel.hsdp_replicate_size:
        return [
            f"--hsdp-replicate-size {parallel.hsdp_replicate_size} must divide the world "
            f"size {world} (--sequence-parallel-size)"
        ]
    if parallel.effective_hsdp_shard_size * parallel.hsdp_replicate_size != world:
        return [
            f"--hsdp-shard-size {parallel.hsdp_shard_size} x --hsdp-replicate-size "
            f"{parallel.hsdp_replicate_size} must equal the world size {world}; "
            "use --hsdp-shard-size -1 to derive it"
        ]
    return []


def _dlo_options_without_dlo(offload: OffloadOptions) -> list[str]:
    defaults = OffloadOptions()
    set_dlo_options = [
        NEGATIVE_FLAGS.get(name, flag_for(name))
        for name in OffloadOptions.model_fields
        if name.startswith("dlo_") and getattr(offload, name) != getattr(defaults, name)
    ]
    if not set_dlo_options:
        return []
    return [
        f"{', '.join(set_dlo_options)} apply only to DLO; add "
        "--enable-distributed-layerwise-offload or drop them"
    ]


class EffectiveConfig(_Options):
    """What the worker will do, derived purely from a valid :class:`WorkerConfig`."""

    offload_policy: OffloadPolicy
    transfer_mode: TransferMode
    dlo_sharding_group: ShardingGroup
    dlo_sharding_size: int
    dlo_resident_layers: int
    host_backing_candidates: list[HostBacking]
    """Host backings the loader may choose, most preferred first."""
    world_size: int
    warnings: list[str]


def dlo_sharding_group(parallel: ParallelOptions, use_allgather: bool) -> tuple[ShardingGroup, int]:
    """The DLO weight-sharding group and its size.

    The existing DP group when DP > 1, else the SP group when SP > 1, else none.
    Without AllGather DLO streams complete blocks, so the effective size is one.
    TP is never DLO's group.
    """
    if not use_allgather:
        return ShardingGroup.NONE, 1
    if parallel.data_parallel_size > 1:
        return ShardingGroup.DATA_PARALLEL, parallel.data_parallel_size
    if parallel.sequence_parallel_size > 1:
        return ShardingGroup.SEQUENCE_PARALLEL, parallel.sequence_parallel_size
    return ShardingGroup.NONE, 1


def _host_backing_candidates(config: WorkerConfig) -> list[HostBacking]:
    offload, parallel = config.offload, config.parallel
    if not offload.enable_distributed_layerwise_offload:
        return [HostBacking.ORDINARY]
    checkpoint_mmap_possible = (
        parallel.tensor_parallel_size == 1
        and not parallel.use_hsdp
        and config.model.quantization == Quantization.NONE
    )
    candidates: list[HostBacking] = []
    # A positive registration budget asks for the transform-complete final layout,
    # so the runtime cache wins over a checkpoint mapping that may need adapters.
    if offload.dlo_enable_runtime_cache and offload.dlo_runtime_cache_pin_limit_gib > 0:
        candidates.append(HostBacking.RUNTIME_CACHE)
    elif checkpoint_mmap_possible:
        candidates.append(HostBacking.CHECKPOINT_MMAP)
    if offload.dlo_enable_runtime_cache and HostBacking.RUNTIME_CACHE not in candidates:
        candidates.append(HostBacking.RUNTIME_CACHE)
    candidates.append(HostBacking.ORDINARY)
    return candidates


def resolve(config: WorkerConfig) -> EffectiveConfig:
    """Derive the effective offload decisions from a validated configuration (pure)."""
    offload = config.offload
    warnings: list[str] = []
    if offload.enable_distributed_layerwise_offload:
        policy = OffloadPolicy.DLO
        for name in ("enable_cpu_offload", "enable_layerwise_offload"):
            if getattr(offload, name):
                warnings.append(
                    f"{flag_for(name)} is disabled because "
                    "--enable-distributed-layerwise-offload takes priority"
                )
        group, size = dlo_sharding_group(config.parallel, offload.dlo_use_allgather)
        transfer = TransferMode.ALLGATHER if size > 1 else TransferMode.RANK_LOCAL
    else:
        if offload.enable_cpu_offload:
            policy = OffloadPolicy.MODEL_CPU_OFFLOAD
        elif offload.enable_layerwise_offload:
            policy = OffloadPolicy.LAYERWISE_OFFLOAD
        else:
            policy = OffloadPolicy.NONE
        group, size, transfer = ShardingGroup.NONE, 1, TransferMode.NONE
    return EffectiveConfig(
        offload_policy=policy,
        transfer_mode=transfer,
        dlo_sharding_group=group,
        dlo_sharding_size=size,
        dlo_resident_layers=offload.dlo_resident_layers if policy == OffloadPolicy.DLO else 0,
        host_backing_candidates=_host_backing_candidates(config),
        world_size=config.parallel.world_size,
        warnings=warnings,
    )


def default_runtime_cache_root() -> Path:
    """``$XDG_CACHE_HOME/dlo-worker/runtime-cache`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dlo-worker" / "runtime-cache"


def _flag_value(value: object) -> str:
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def to_flags(config: WorkerConfig) -> list[str]:
    """The CLI flags that reproduce ``config`` (non-default fields only); the inverse of
    parsing. The operator renders worker command lines with it."""
    flags: list[str] = []
    for group_name in WorkerConfig.model_fields:
        group = getattr(config, group_name)
        for name, field in type(group).model_fields.items():
            value = getattr(group, name)
            if value == field.default:
                continue
            if isinstance(value, bool):
                flags.append(flag_for(name) if value else NEGATIVE_FLAGS[name])
            else:
                flags += [flag_for(name), _flag_value(value)]
    return flags


class ConfigError(ValueError, UserFixableError):
    """An invalid configuration, as one line that names the options and the fix."""


def _field_flag(location: tuple[int | str, ...]) -> str | None:
    names = [part for part in location if isinstance(part, str)]
    return flag_for(names[-1]) if names else None


def describe_validation_error(error: ValidationError) -> str:
    """Render a pydantic error as one line naming each offending flag."""
    parts: list[str] = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        flag = _field_flag(item["loc"])
        if item["type"] == "value_error" or flag is None:
            parts.append(message)
        elif item["type"] == "extra_forbidden":
            parts.append(f"{flag} is not a known option")
        else:
            parts.append(f"{flag}: {message[0].lower()}{message[1:]} (got {item['input']!r})")
    return "; ".join(parts)


def execution_errors(config: WorkerConfig) -> list[str]:
    """What this worker release cannot execute although the options are valid (pure).

    The configuration models the whole design (the operator validates against it), but
    quantization other than per-tensor FP8, TP and HSDP are not implemented, and diffusers'
    offload modes need a CUDA device and run neither under SP nor with FP8. ``generate``,
    ``serve`` and the operator refuse them with these messages (each names what would be
    needed) instead of failing later.
    """
    errors: list[str] = []
    policy = config.effective().offload_policy
    if (
        policy in (OffloadPolicy.MODEL_CPU_OFFLOAD, OffloadPolicy.LAYERWISE_OFFLOAD)
        and config.model.device == "cpu"
    ):
        flag = flag_for(
            "enable_cpu_offload"
            if policy == OffloadPolicy.MODEL_CPU_OFFLOAD
            else "enable_layerwise_offload"
        )
        errors.append(
            f"{flag} moves weights between host memory and a CUDA device, and --device is "
            "cpu: drop the flag (on the CPU everything is in host memory already)"
        )
    quantization = config.model.quantization
    if quantization not in (Quantization.NONE, Quantization.FP8):
        errors.append(
            f"--quantization {quantization} is not executed by this worker release; use "
            "--quantization fp8 (per-tensor FP8 weights) or none"
        )
    elif quantization == Quantization.FP8 and policy in (
        OffloadPolicy.MODEL_CPU_OFFLOAD,
        OffloadPolicy.LAYERWISE_OFFLOAD,
    ):
        errors.append(
            "--quantization fp8 is not run under diffusers' offload modes by this worker "
            "release; stream the FP8 weights with --enable-distributed-layerwise-offload, or "
            "run resident"
        )
    parallel = config.parallel
    if parallel.sequence_parallel_size > 1 and policy in (
        OffloadPolicy.MODEL_CPU_OFFLOAD,
        OffloadPolicy.LAYERWISE_OFFLOAD,
    ):
        flag = flag_for(
            "enable_cpu_offload"
            if policy == OffloadPolicy.MODEL_CPU_OFFLOAD
            else "enable_layerwise_offload"
        )
        errors.append(
            f"--sequence-parallel-size {parallel.sequence_parallel_size} with {flag}: "
            "diffusers' offload modes are not run under sequence parallelism by this worker "
            "release; use --enable-distributed-layerwise-offload (DLO shards host weights "
            "over the SP group) or --sequence-parallel-size 1"
        )
    if parallel.tensor_parallel_size > 1:
        errors.append(
            f"--tensor-parallel-size {parallel.tensor_parallel_size}: tensor parallelism needs "
            "every DiT's attention and MLP linears sharded column- and row-wise (diffusers "
            "plans that for a few classes only, as DTensors) and DLO streaming DTensor "
            "shards, which this worker release does not implement; set "
            "--tensor-parallel-size 1 and split work with --sequence-parallel-size or "
            "--data-parallel-size"
        )
    if parallel.use_hsdp:
        errors.append(
            "--use-hsdp: HSDP needs each DiT wrapped in FSDP2 with its own parameter "
            "lifecycle, which this worker does not implement (and DLO never shards an HSDP "
            "group again); drop --use-hsdp and use --data-parallel-size with DLO AllGather, "
            "which shards host weights over DP"
        )
    return errors


def build_config(values: dict[str, dict[str, Any]]) -> WorkerConfig:
    """Validate grouped option values into a :class:`WorkerConfig` or raise :class:`ConfigError`."""
    try:
        return WorkerConfig.model_validate(values)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None
