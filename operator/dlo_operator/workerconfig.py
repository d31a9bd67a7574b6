"""The worker configuration a DiffusionDeployment implies, and the rules only the operator knows.

The DLO compatibility matrix is not restated here: the spec is mapped onto
:class:`dlo_worker.config.WorkerConfig` and the worker's own validation decides,
so an invalid spec is reported with the message ``dlo-worker`` would print, its flags
replaced by the CRD fields that set them (:func:`in_crd_terms`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

from kubernetes.utils import parse_quantity
from pydantic import BaseModel

from dlo_operator.api import Accelerator, DiffusionDeploymentSpec, Lora
from dlo_worker.config import (
    NEGATIVE_FLAGS,
    ConfigError,
    ModelOptions,
    OffloadOptions,
    ParallelOptions,
    WorkerConfig,
    build_config,
    execution_errors,
    flag_for,
)

LORA_MOUNT_ROOT = "/var/lib/dlo/loras"
"""Where each mounted LoRA adapter appears, at ``<root>/<name>``, in every container."""
RUNTIME_CACHE_MOUNT_PATH = "/var/cache/dlo-worker"
"""Where the node's runtime-cache hostPath appears inside every worker container."""
COMPILE_CACHE_MOUNT_PATH = "/var/cache/dlo-compile"
"""The Pod's emptyDir for inductor's compiled graphs (without the runtime cache)."""

GIB = Decimal(2**30)


@dataclass(frozen=True)
class CrdField:
    """Where a worker option comes from in a DiffusionDeployment."""

    path: str
    """The field as its author writes it (``offload.runtimeCache.pinLimitGiB``)."""
    value: Callable[[DiffusionDeploymentSpec], object]
    """The option's value for a spec."""
    only_with_cache: bool = False
    """Rendered only with the runtime cache enabled (the worker's default otherwise)."""


def model_path(spec: DiffusionDeploymentSpec) -> str:
    """The model directory as the worker sees it."""
    return spec.model.image_path or spec.model.mount_path


def _device(spec: DiffusionDeploymentSpec) -> str:
    return "cuda" if spec.accelerator == Accelerator.NVIDIA_GPU else "cpu"


def runtime_cache_mounted(spec: DiffusionDeploymentSpec) -> bool:
    """Whether the node's runtime-cache hostPath is mounted in the worker containers."""
    return spec.offload.enabled and spec.offload.runtime_cache.enabled


def compile_cache_dir(spec: DiffusionDeploymentSpec) -> str | None:
    """Where ``--compile`` keeps inductor's compiled graphs: beside the runtime cache on the
    node's hostPath when it is mounted (a Pod restarted or rescheduled onto the node loads
    them), else on an emptyDir of the Pod (a restarted container loads them)."""
    if not spec.compile.enabled:
        return None
    if runtime_cache_mounted(spec):
        return f"{RUNTIME_CACHE_MOUNT_PATH}/compile"
    return COMPILE_CACHE_MOUNT_PATH


def lora_path(lora: Lora) -> str:
    """The adapter's path as the worker sees it: in the image, or where it is mounted."""
    return lora.image_path or f"{LORA_MOUNT_ROOT}/{lora.name}"


def _loras(spec: DiffusionDeploymentSpec) -> tuple[str, ...]:
    return tuple(f"{lora.name}={lora_path(lora)}:{lora.scale:g}" for lora in spec.loras)


def _block_paths(spec: DiffusionDeploymentSpec) -> tuple[str, ...] | None:
    return tuple(spec.offload.block_paths) if spec.offload.block_paths else None


CRD_FIELDS: dict[str, CrdField] = {
    "model": CrdField("model", model_path),
    "dtype": CrdField("dtype", lambda spec: spec.dtype),
    "device": CrdField("accelerator", _device),
    "quantization": CrdField("quantization", lambda spec: spec.quantization),
    "compile": CrdField("compile.enabled", lambda spec: spec.compile.enabled),
    "compile_mode": CrdField("compile.mode", lambda spec: spec.compile.mode),
    "compile_cache_dir": CrdField("compile.enabled", compile_cache_dir),
    "lora": CrdField("loras", _loras),
    "fuse_lora": CrdField(
        "loras[].fuse", lambda spec: tuple(lora.name for lora in spec.loras if lora.fuse)
    ),
    "data_parallel_size": CrdField("parallelism.data", lambda spec: spec.parallelism.data),
    "sequence_parallel_size": CrdField(
        "parallelism.sequence", lambda spec: spec.parallelism.sequence
    ),
    "tensor_parallel_size": CrdField("parallelism.tensor", lambda spec: spec.parallelism.tensor),
    "use_hsdp": CrdField("parallelism.hsdp.enabled", lambda spec: spec.parallelism.hsdp.enabled),
    "hsdp_shard_size": CrdField(
        "parallelism.hsdp.shardSize", lambda spec: spec.parallelism.hsdp.shard_size
    ),
    "hsdp_replicate_size": CrdField(
        "parallelism.hsdp.replicateSize", lambda spec: spec.parallelism.hsdp.replicate_size
    ),
    "enable_distributed_layerwise_offload": CrdField(
        "offload.enabled", lambda spec: spec.offload.enabled
    ),
    "dlo_use_allgather": CrdField("offload.useAllGather", lambda spec: spec.offload.use_all_gather),
    "dlo_resident_layers": CrdField(
        "offload.residentLayers", lambda spec: spec.offload.resident_layers
    ),
    "dlo_gpu_memory_budget_gib": CrdField(
        "offload.gpuMemoryBudgetGiB", lambda spec: spec.offload.gpu_memory_budget_gib
    ),
    "max_gpu_memory_gib": CrdField(
        "offload.maxGpuMemoryGiB", lambda spec: spec.offload.max_gpu_memory_gib
    ),
    "dlo_stream_text_encoders": CrdField(
        "offload.streamTextEncoders", lambda spec: tuple(spec.offload.stream_text_encoders)
    ),
    "dlo_allgather_shard_buffers": CrdField(
        "offload.allGatherShardBuffers", lambda spec: spec.offload.all_gather_shard_buffers
    ),
    "dlo_block_paths": CrdField("offload.blockPaths", _block_paths),
    "dlo_staging": CrdField("offload.staging.mode", lambda spec: spec.offload.staging.mode),
    "dlo_staging_chunk_mib": CrdField(
        "offload.staging.chunkMiB", lambda spec: spec.offload.staging.chunk_mib
    ),
    "dlo_pack_threads": CrdField(
        "offload.staging.packThreads", lambda spec: spec.offload.staging.pack_threads
    ),
    "dlo_enable_runtime_cache": CrdField(
        "offload.runtimeCache.enabled", lambda spec: spec.offload.runtime_cache.enabled
    ),
    "dlo_runtime_cache_pin_limit_gib": CrdField(
        "offload.runtimeCache.pinLimitGiB", lambda spec: spec.offload.runtime_cache.pin_limit_gib
    ),
    # The node's hostPath, mounted at the same place in every container.
    "dlo_runtime_cache_root": CrdField(
        "offload.runtimeCache.hostPath", lambda _spec: RUNTIME_CACHE_MOUNT_PATH, True
    ),
    "dlo_runtime_cache_lock_timeout": CrdField(
        "offload.runtimeCache.lockTimeoutSeconds",
        lambda spec: spec.offload.runtime_cache.lock_timeout_seconds,
        True,
    ),
    "dlo_runtime_cache_size_budget_gib": CrdField(
        "offload.runtimeCache.sizeBudgetGiB",
        lambda spec: spec.offload.runtime_cache.size_budget_gib,
        True,
    ),
    "dlo_runtime_cache_skip_load": CrdField(
        "offload.runtimeCache.skipLoad", lambda spec: spec.offload.runtime_cache.skip_load, True
    ),
}
"""The one mapping from CRD fields to worker options: :func:`worker_config` is built from
it, and :func:`in_crd_terms` translates the worker's messages with it."""
_GROUPS: dict[str, type[BaseModel]] = {
    "model": ModelOptions,
    "parallel": ParallelOptions,
    "offload": OffloadOptions,
}
_BOOLEAN_OPTIONS = {
    name
    for options in (ModelOptions, ParallelOptions, OffloadOptions)
    for name, field in options.model_fields.items()
    if field.annotation is bool
}
_CRD_TERMS = {
    **{
        flag_for(name): f"{field.path}: true" if name in _BOOLEAN_OPTIONS else field.path
        for name, field in CRD_FIELDS.items()
    },
    **{flag: f"{CRD_FIELDS[name].path}: false" for name, flag in NEGATIVE_FLAGS.items()},
}


def in_crd_terms(message: str) -> str:
    """The worker's message with each of its flags replaced by the CRD field that sets it
    (a DiffusionDeployment's author writes fields, never flags)."""
    return re.sub(r"--[a-z][a-z0-9-]*", lambda flag: _CRD_TERMS.get(flag[0], flag[0]), message)


class InvalidSpecError(ValueError):
    """The spec passed the API server's schema but cannot run; the message says why."""


def worker_config(spec: DiffusionDeploymentSpec) -> WorkerConfig:
    """The worker configuration of every rank of an engine (raises InvalidSpecError)."""
    cache = spec.offload.runtime_cache.enabled
    values: dict[str, dict[str, object]] = {group: {} for group in _GROUPS}
    for name, field in CRD_FIELDS.items():
        if field.only_with_cache and not cache:
            continue
        group = next(group for group, options in _GROUPS.items() if name in options.model_fields)
        values[group][name] = field.value(spec)
    try:
        config = build_config(values)
    except ConfigError as error:
        raise InvalidSpecError(in_crd_terms(str(error))) from None
    if errors := execution_errors(config):
        # Valid for the design, but the worker would exit at start-up: refuse it here.
        raise InvalidSpecError(in_crd_terms("; ".join(errors)))
    return config


def pinned_budget_bytes(spec: DiffusionDeploymentSpec) -> Decimal:
    """Host memory each Pod page-locks on purpose: the registration budget of every rank
    (runtime-cache entries and checkpoint mappings alike)."""
    cache = spec.offload.runtime_cache
    if not spec.offload.enabled:
        return Decimal(0)
    return Decimal(str(cache.pin_limit_gib)) * GIB * spec.gpus_per_node


def memory_floor_bytes(spec: DiffusionDeploymentSpec) -> Decimal:
    """The least memory limit a Pod needs: pinned budget plus the memory-backed /dev/shm."""
    return pinned_budget_bytes(spec) + parse_quantity(spec.shm_size)


def validate(spec: DiffusionDeploymentSpec) -> WorkerConfig:
    """Everything the API server cannot check; returns the worker configuration."""
    config = worker_config(spec)
    if spec.accelerator == Accelerator.NONE and spec.offload.runtime_cache.pin_limit_gib > 0:
        raise InvalidSpecError(
            "offload.runtimeCache.pinLimitGiB registers host memory with the GPU driver, and "
            "accelerator none has no GPU: set pinLimitGiB to 0 or use accelerator nvidia-gpu"
        )
    if spec.resources.memory is not None:
        limit, floor = parse_quantity(spec.resources.memory), memory_floor_bytes(spec)
        if limit < floor:
            raise InvalidSpecError(
                f"resources.memory {spec.resources.memory} cannot hold the pinned budget "
                f"(runtimeCache.pinLimitGiB {spec.offload.runtime_cache.pin_limit_gib} x "
                f"gpusPerNode {spec.gpus_per_node}) plus shmSize {spec.shm_size} = "
                f"{float(floor / GIB):.1f} GiB; raise resources.memory or lower the budget"
            )
    return config
