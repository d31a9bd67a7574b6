"""What the worker will do, derived purely from a valid configuration (no I/O but the
environment variable that places the default cache root, and whether this installation
built the native staging ring)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dlo_worker.config.flags import flag_for
from dlo_worker.config.values import (
    CompileMode,
    HostBacking,
    OffloadPolicy,
    Options,
    Quantization,
    ShardingGroup,
    SkipLoad,
    Staging,
    TransferMode,
)
from dlo_worker.native import staging_ring_library

if TYPE_CHECKING:
    from dlo_worker.config.schema import ParallelOptions, WorkerConfig


class EffectiveConfig(Options):
    """What the worker will do, derived purely from a valid :class:`WorkerConfig`."""

    offload_policy: OffloadPolicy
    offload_planned_at_start: bool
    """``--max-gpu-memory-gib``: the policy above holds where the pipeline fits the budget;
    where it does not, the start plans DLO (rank-local) and these decisions become the
    plan's (its ``device memory plan`` log line says which)."""
    transfer_mode: TransferMode
    dlo_sharding_group: ShardingGroup
    dlo_sharding_size: int
    dlo_resident_layers: int
    host_backing_candidates: list[HostBacking]
    """Host backings the loader may choose, most preferred first."""
    dlo_staging: Staging | None
    """How mapped blocks that are not registered are packed (``ring`` or ``buffers``,
    ``auto`` resolved for this installation); ``None`` without DLO."""
    world_size: int
    compile: CompileMode | None
    """The mode each DiT's repeated blocks are compiled with (``None``: eager)."""
    compile_cache_dir: Path | None
    """Where inductor keeps compiled graphs (``None``: its default, or nothing compiled)."""
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
        # Fusing writes adapters into the host weights: never into the checkpoint's pages.
        and not config.model.fuse_lora
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


def resolve_staging(staging: Staging) -> Staging:
    """``auto`` becomes the ring where this installation built it, else block buffers."""
    if staging != Staging.AUTO:
        return staging
    return Staging.RING if staging_ring_library() is not None else Staging.BUFFERS


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
        offload_planned_at_start=offload.max_gpu_memory_gib is not None,
        transfer_mode=transfer,
        dlo_sharding_group=group,
        dlo_sharding_size=size,
        dlo_resident_layers=offload.dlo_resident_layers if policy == OffloadPolicy.DLO else 0,
        host_backing_candidates=_host_backing_candidates(config),
        dlo_staging=resolve_staging(offload.dlo_staging) if policy == OffloadPolicy.DLO else None,
        world_size=config.parallel.world_size,
        compile=config.model.compile_mode if config.model.compile else None,
        compile_cache_dir=config.model.compile_cache_dir,
        warnings=warnings,
    )


@dataclass(frozen=True)
class RuntimeCacheSettings:
    """Where the node-local runtime cache lives and how this process uses it."""

    root: Path
    lock_timeout_s: float
    size_budget_bytes: int | None
    """Upper bound of the node's entries (None: unbounded)."""
    skip_load: SkipLoad
    tensor_parallel_size: int
    sequence_parallel_size: int


@dataclass(frozen=True)
class LoadSettings:
    """What the loader acts on: the pipeline directory, whether its DiTs stream, and the
    host backings it may choose from (the loader never sees the whole configuration)."""

    model_dir: Path
    offload_policy: OffloadPolicy
    block_paths: tuple[str, ...] | None
    streamed_text_encoders: tuple[str, ...]
    """Text encoders DLO streams: loaded into host memory like streamed DiTs."""
    host_backings: tuple[HostBacking, ...]
    """Most preferred first (:attr:`EffectiveConfig.host_backing_candidates`)."""
    runtime_cache: RuntimeCacheSettings | None
    """Set when the runtime cache is among the host backings of streamed DiTs."""

    @property
    def streams_dit(self) -> bool:
        return self.offload_policy == OffloadPolicy.DLO


def load_settings(config: WorkerConfig) -> LoadSettings:
    """The loader's part of a validated configuration that names a model (pure but for
    the default cache root's environment variable)."""
    if config.model.model is None:
        raise ValueError("--model is required")
    effective = config.effective()
    offload, parallel = config.offload, config.parallel
    backings = tuple(effective.host_backing_candidates)
    runtime_cache = None
    if effective.offload_policy == OffloadPolicy.DLO and HostBacking.RUNTIME_CACHE in backings:
        budget_gib = offload.dlo_runtime_cache_size_budget_gib
        runtime_cache = RuntimeCacheSettings(
            root=offload.dlo_runtime_cache_root or default_runtime_cache_root(),
            lock_timeout_s=offload.dlo_runtime_cache_lock_timeout,
            size_budget_bytes=None if budget_gib is None else round(budget_gib * 2**30),
            skip_load=offload.dlo_runtime_cache_skip_load,
            tensor_parallel_size=parallel.tensor_parallel_size,
            sequence_parallel_size=parallel.sequence_parallel_size,
        )
    return LoadSettings(
        model_dir=config.model.model,
        offload_policy=effective.offload_policy,
        block_paths=offload.dlo_block_paths,
        streamed_text_encoders=offload.dlo_stream_text_encoders
        if effective.offload_policy == OffloadPolicy.DLO
        else (),
        host_backings=backings,
        runtime_cache=runtime_cache,
    )


def default_runtime_cache_root() -> Path:
    """``$XDG_CACHE_HOME/dlo-worker/runtime-cache`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dlo-worker" / "runtime-cache"
