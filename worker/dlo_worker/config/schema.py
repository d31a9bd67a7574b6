"""Every option, its default and its own range: three groups (model, parallel, offload)
in one :class:`WorkerConfig`, validated against :mod:`~dlo_worker.config.rules` when built."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dlo_worker.config.effective import EffectiveConfig, resolve
from dlo_worker.config.flags import describe_validation_error, flag_for
from dlo_worker.config.rules import combination_errors
from dlo_worker.config.values import (
    CompileMode,
    DType,
    LoraAdapter,
    Options,
    Quantization,
    SkipLoad,
    Staging,
    parse_lora,
)
from dlo_worker.errors import UserFixableError

DEFAULT_RUNTIME_CACHE_LOCK_TIMEOUT_S = 600.0
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _finite(value: float, field_name: str) -> float:
    if not math.isfinite(value):
        raise ValueError(
            f"{flag_for(field_name)} must be a finite number, got {value!r}; give a plain number"
        )
    return value


def _comma_separated(value: object) -> list[str] | None:
    """A repeatable flag's values, each possibly comma-separated; None when ``value`` is
    neither a string nor a list (pydantic then says what it expected)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple):
        return None
    return [part.strip() for item in value for part in str(item).split(",") if part.strip()]


class ModelOptions(Options):
    """What to load and where to run it."""

    model: Path | None = Field(
        default=None, description="Diffusers-format pipeline directory (model_index.json)."
    )
    dtype: DType = Field(default=DType.AUTO, description="Weight and compute dtype.")
    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N.")
    quantization: Quantization = Field(
        default=Quantization.NONE, description="Online weight quantization method."
    )
    compile: bool = Field(
        default=False,
        description="Compile each DiT's repeated blocks (torch.compile, fullgraph, one graph "
        "per block), resident or streamed by DLO alike; the first step compiles.",
    )
    compile_mode: CompileMode = Field(
        default=CompileMode.DEFAULT,
        description="torch.compile mode of --compile: default, max-autotune-no-cudagraphs "
        "or reduce-overhead (CUDA graphs over each compiled block; CUDA devices only).",
    )
    compile_cache_dir: Path | None = Field(
        default=None,
        description="Directory of inductor's compiled-graph cache (TORCHINDUCTOR_CACHE_DIR): "
        "a restarted worker that finds its graphs there loads them instead of generating "
        "and building kernels (Dynamo still traces each block). Default: inductor's own, "
        "under /tmp.",
    )

    lora: tuple[str, ...] = Field(
        default=(),
        description="LoRA adapters loaded at start and applied to every image, "
        "NAME=PATH[:SCALE] each (comma-separated, or the flag repeated): a diffusers LoRA "
        "safetensors file or a directory holding one (diffusers converts Kohya and other "
        "community formats); SCALE from -10 to 10, default 1.",
    )

    fuse_lora: tuple[str, ...] = Field(
        default=(),
        description="Names of --lora adapters fused into the DiT's host weights once at "
        "start (comma-separated, or the flag repeated), at their --lora scale: they then "
        "cost nothing per step and always apply, and requests cannot choose them. Needs a "
        "private host copy: the DiT is loaded into ordinary tensors, or into a runtime-cache "
        "entry keyed by the adapters' content, never a shared checkpoint mapping.",
    )

    max_lora_rank: int | None = Field(
        default=None,
        ge=1,
        description="The largest rank a LoRA adapter kept beside the weights may have "
        "(--lora not fused, and adapters loaded while serving); a larger one is refused "
        "naming its rank. Default: no limit.",
    )

    @field_validator("lora", mode="before")
    @classmethod
    def _parse_loras(cls, value: object) -> object:
        texts = _comma_separated(value)
        if texts is None:
            return value
        adapters = [parse_lora(text) for text in texts]
        names = [adapter.name for adapter in adapters]
        if duplicates := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"--lora names {', '.join(duplicates)} more than once; one each")
        return tuple(str(adapter) for adapter in adapters)

    @property
    def lora_adapters(self) -> tuple[LoraAdapter, ...]:
        """``--lora``, parsed."""
        return tuple(parse_lora(text) for text in self.lora)

    @field_validator("fuse_lora", mode="before")
    @classmethod
    def _split_fused(cls, value: object) -> object:
        texts = _comma_separated(value)
        if texts is None:
            return value
        if duplicates := sorted({text for text in texts if texts.count(text) > 1}):
            raise ValueError(f"--fuse-lora names {', '.join(duplicates)} more than once; one each")
        return tuple(texts)

    @model_validator(mode="after")
    def _fused_adapters_are_loaded(self) -> ModelOptions:
        names = {adapter.name for adapter in self.lora_adapters}
        if unknown := [name for name in self.fuse_lora if name not in names]:
            raise ValueError(
                f"--fuse-lora {', '.join(unknown)}: no --lora adapter has that name; give "
                "the adapter with --lora NAME=PATH[:SCALE] too"
            )
        return self

    @property
    def fused_lora_adapters(self) -> tuple[LoraAdapter, ...]:
        """The ``--lora`` adapters ``--fuse-lora`` names, in its order (the order they are
        fused in)."""
        adapters = {adapter.name: adapter for adapter in self.lora_adapters}
        return tuple(adapters[name] for name in self.fuse_lora)

    @property
    def switchable_lora_adapters(self) -> tuple[LoraAdapter, ...]:
        """The ``--lora`` adapters not fused: loaded beside the weights, chosen per request."""
        return tuple(
            adapter for adapter in self.lora_adapters if adapter.name not in self.fuse_lora
        )

    @property
    def switchable_lora_names(self) -> tuple[str, ...]:
        """The names requests choose adapters by."""
        return tuple(adapter.name for adapter in self.switchable_lora_adapters)

    @field_validator("device")
    @classmethod
    def _device_is_known(cls, value: str) -> str:
        if not _DEVICE_PATTERN.match(value):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value


class ParallelOptions(Options):
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


class OffloadOptions(Options):
    """Offload strategy and the DLO options (``--dlo-*`` flags, docs/configuration.md)."""

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
    max_gpu_memory_gib: float | None = Field(
        default=None,
        description="Device memory (GiB) the whole pipeline may use: weights, DLO's slots and "
        "activations. At start the worker plans every component against it and logs the "
        "plan: all resident when the pipeline fits, else the DiT streamed by DLO with as many "
        "resident blocks as fit, and a streamable text encoder (T5) streamed too when "
        "needed; refused naming the memory needed when nothing fits. On a larger CUDA device "
        "the allocator is capped at it (so a smaller GPU can be emulated).",
    )
    dlo_stream_text_encoders: tuple[str, ...] = Field(
        default=(),
        description="Comma-separated text encoder components (e.g. text_encoder_2, Flux's "
        "T5-XXL) DLO streams through the DiT's two slots, once per prompt encoding, instead "
        "of holding them on the device; --max-gpu-memory-gib chooses them when unset.",
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
    dlo_staging: Staging = Field(
        default=Staging.AUTO,
        description="How rank-local DLO packs mapped DiT blocks that are not registered (a "
        "checkpoint mapping, a runtime-cache entry) for the copy engine: ring (the native "
        "ring of cache-sized chunks), buffers (block-sized pinned buffers), or auto: the "
        "ring where this installation built it, else buffers with a warning.",
    )
    dlo_staging_chunk_mib: Annotated[int, Field(ge=1, le=256)] | None = Field(
        default=None,
        description="Chunk size (MiB) of the staging ring; default: from the CPU's last-level "
        "cache (the ring, two chunks per pack thread, takes at most a third of it; 4-8 MiB).",
    )
    dlo_pack_threads: Annotated[int, Field(ge=1, le=64)] | None = Field(
        default=None,
        description="Host threads that pack mapped DiT blocks (the staging ring's packers, "
        "block-buffer packs, AllGather shards read from a mapping); default: this process's "
        "share of the CPUs it may run on, at most its cgroup's CPU limit (CPUs / ranks on "
        "the node), less 2 (its model thread and the ring's feeder), at most 8.",
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

    @field_validator("dlo_stream_text_encoders", mode="before")
    @classmethod
    def _split_text_encoders(cls, value: object) -> object:
        names = _comma_separated(value)
        return value if names is None else tuple(names)

    @field_validator("dlo_runtime_cache_lock_timeout")
    @classmethod
    def _lock_timeout_positive(cls, value: float) -> float:
        _finite(value, "dlo_runtime_cache_lock_timeout")
        if value <= 0:
            raise ValueError(f"--dlo-runtime-cache-lock-timeout must be > 0 seconds, got {value!r}")
        return value

    @field_validator("dlo_gpu_memory_budget_gib", "max_gpu_memory_gib")
    @classmethod
    def _budget_positive(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is None:
            return value
        field_name = info.field_name or ""
        _finite(value, field_name)
        if value <= 0:
            raise ValueError(f"{flag_for(field_name)} must be > 0 GiB, got {value!r}")
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


class WorkerConfig(Options):
    """The whole worker configuration, validated against the DLO compatibility matrix.

    Built only by validation (:func:`build_config`, ``model_validate``): that is where the
    rules run and where the effective configuration is resolved, once.
    """

    model: ModelOptions = ModelOptions()
    parallel: ParallelOptions = ParallelOptions()
    offload: OffloadOptions = OffloadOptions()
    _effective: EffectiveConfig | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _combinations_are_supported(self) -> WorkerConfig:
        problems = combination_errors(self)
        if problems:
            raise ValueError("; ".join(problems))
        self._effective = resolve(self)
        return self

    def effective(self) -> EffectiveConfig:
        """The decisions the rest of the worker acts on, resolved once at validation
        (pure; see :func:`resolve`)."""
        if self._effective is None:
            raise RuntimeError("a WorkerConfig is built by validation (build_config)")
        return self._effective


class ConfigError(ValueError, UserFixableError):
    """An invalid configuration, as one line that names the options and the fix."""


def build_config(values: dict[str, dict[str, Any]]) -> WorkerConfig:
    """Validate grouped option values into a :class:`WorkerConfig` or raise :class:`ConfigError`."""
    try:
        return WorkerConfig.model_validate(values)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None
