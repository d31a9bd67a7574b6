"""The worker configuration a DiffusionDeployment implies, and the rules only the operator knows.

The DLO compatibility matrix is not restated here: the spec is mapped onto
:class:`dlo_worker.config.WorkerConfig` and the worker's own validation decides,
so an invalid spec is reported with the message ``dlo-worker`` would print, its flags
replaced by the CRD fields that set them (:func:`in_crd_terms`).
"""

from __future__ import annotations

import re
from decimal import Decimal

from kubernetes.utils import parse_quantity

from dlo_operator.api import Accelerator, DiffusionDeploymentSpec
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

RUNTIME_CACHE_MOUNT_PATH = "/var/cache/dlo-worker"
"""Where the node's runtime-cache hostPath appears inside every worker container."""

GIB = Decimal(2**30)

CRD_FIELDS = {
    "model": "model",
    "dtype": "dtype",
    "device": "accelerator",
    "quantization": "quantization",
    "data_parallel_size": "parallelism.data",
    "sequence_parallel_size": "parallelism.sequence",
    "tensor_parallel_size": "parallelism.tensor",
    "use_hsdp": "parallelism.hsdp.enabled",
    "hsdp_shard_size": "parallelism.hsdp.shardSize",
    "hsdp_replicate_size": "parallelism.hsdp.replicateSize",
    "enable_distributed_layerwise_offload": "offload.enabled",
    "dlo_use_allgather": "offload.useAllGather",
    "dlo_resident_layers": "offload.residentLayers",
    "dlo_gpu_memory_budget_gib": "offload.gpuMemoryBudgetGiB",
    "dlo_allgather_shard_buffers": "offload.allGatherShardBuffers",
    "dlo_block_paths": "offload.blockPaths",
    "dlo_enable_runtime_cache": "offload.runtimeCache.enabled",
    "dlo_runtime_cache_pin_limit_gib": "offload.runtimeCache.pinLimitGiB",
    "dlo_runtime_cache_root": "offload.runtimeCache.hostPath",
    "dlo_runtime_cache_lock_timeout": "offload.runtimeCache.lockTimeoutSeconds",
    "dlo_runtime_cache_size_budget_gib": "offload.runtimeCache.sizeBudgetGiB",
    "dlo_runtime_cache_skip_load": "offload.runtimeCache.skipLoad",
}
"""The CRD field that sets each worker option the operator renders."""
_BOOLEAN_OPTIONS = {
    name
    for options in (ModelOptions, ParallelOptions, OffloadOptions)
    for name, field in options.model_fields.items()
    if field.annotation is bool
}
_CRD_TERMS = {
    **{
        flag_for(name): f"{path}: true" if name in _BOOLEAN_OPTIONS else path
        for name, path in CRD_FIELDS.items()
    },
    **{flag: f"{CRD_FIELDS[name]}: false" for name, flag in NEGATIVE_FLAGS.items()},
}


def in_crd_terms(message: str) -> str:
    """The worker's message with each of its flags replaced by the CRD field that sets it
    (a DiffusionDeployment's author writes fields, never flags)."""
    return re.sub(r"--[a-z][a-z0-9-]*", lambda flag: _CRD_TERMS.get(flag[0], flag[0]), message)


class InvalidSpecError(ValueError):
    """The spec passed the API server's schema but cannot run; the message says why."""


def model_path(spec: DiffusionDeploymentSpec) -> str:
    """The model directory as the worker sees it."""
    return spec.model.image_path or spec.model.mount_path


def worker_config(spec: DiffusionDeploymentSpec) -> WorkerConfig:
    """The worker configuration of every rank of an engine (raises InvalidSpecError)."""
    parallelism, offload = spec.parallelism, spec.offload
    cache = offload.runtime_cache
    offload_values: dict[str, object] = {
        "enable_distributed_layerwise_offload": offload.enabled,
        "dlo_use_allgather": offload.use_all_gather,
        "dlo_resident_layers": offload.resident_layers,
        "dlo_gpu_memory_budget_gib": offload.gpu_memory_budget_gib,
        "dlo_allgather_shard_buffers": offload.all_gather_shard_buffers,
        "dlo_block_paths": tuple(offload.block_paths) if offload.block_paths else None,
        "dlo_enable_runtime_cache": cache.enabled,
        "dlo_runtime_cache_pin_limit_gib": cache.pin_limit_gib,
    }
    if cache.enabled:
        offload_values["dlo_runtime_cache_root"] = RUNTIME_CACHE_MOUNT_PATH
        offload_values["dlo_runtime_cache_lock_timeout"] = cache.lock_timeout_seconds
        offload_values["dlo_runtime_cache_size_budget_gib"] = cache.size_budget_gib
        offload_values["dlo_runtime_cache_skip_load"] = cache.skip_load
    try:
        config = build_config(
            {
                "model": {
                    "model": model_path(spec),
                    "dtype": spec.dtype,
                    "device": "cuda" if spec.accelerator == Accelerator.NVIDIA_GPU else "cpu",
                    "quantization": spec.quantization,
                },
                "parallel": {
                    "data_parallel_size": parallelism.data,
                    "sequence_parallel_size": parallelism.sequence,
                    "tensor_parallel_size": parallelism.tensor,
                    "use_hsdp": parallelism.hsdp.enabled,
                    "hsdp_shard_size": parallelism.hsdp.shard_size,
                    "hsdp_replicate_size": parallelism.hsdp.replicate_size,
                },
                "offload": offload_values,
            }
        )
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
