"""The worker's lifecycle: start up in the order below, shut down in reverse.

Start: process groups, then the pipeline (on the CPU when DLO will stream it, with the
``--fuse-lora`` adapters fused into its weights), then the DLO backend, then sequence
parallelism's hooks on the DiTs, then the other ``--lora`` adapters, then (``--compile``)
each DiT's blocks compiled. Shutdown: stop
intake (the caller), then ``backend.disable()`` while the process groups still exist
(it synchronizes outstanding AllGathers), then destroy the process groups. SIGTERM takes the
same path: it is turned into ``SystemExit`` so ``with Worker(...)`` unwinds.
"""

from __future__ import annotations

import logging
import math
import signal
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dlo_worker.config import (
    OffloadPolicy,
    Quantization,
    ShardingGroup,
    Staging,
    WorkerConfig,
    load_settings,
)
from dlo_worker.loader.diffusers_loader import (
    DIT_COMPONENTS,
    BackingDecision,
    DiffusersPipelineLoader,
    HostWeightEdit,
)
from dlo_worker.observability import metrics
from dlo_worker.offload import DistributedLayerwiseOffloadBackend, OffloadConfig
from dlo_worker.offload.feeds import ring as staging_ring
from dlo_worker.offload.host_weights import HostWeightsError
from dlo_worker.pipeline import (
    compilation,
    diffusers_offload,
    lora,
    quantization,
    sequence_parallel,
)
from dlo_worker.process import device_budget
from dlo_worker.process.devices import resolve_device, resolve_dtype
from dlo_worker.process.topology import Topology, init_topology

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from dlo_worker.loader.device_plan import DevicePlan
    from dlo_worker.loader.mapped_checkpoint import MappedCheckpoint
    from dlo_worker.runtime_cache.entry import RuntimeCacheEntry

logger = logging.getLogger(__name__)

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


def _exit_on_sigterm(signum: int, _frame: types.FrameType | None) -> None:
    raise SystemExit(128 + signum)


class Worker:
    """Owns the topology, the pipeline and the offload backend of one process."""

    def __init__(
        self,
        config: WorkerConfig,
        check_pipeline: Callable[[DiffusionPipeline], None] | None = None,
    ) -> None:
        """``check_pipeline`` sees the pipeline before its weights load (its meta skeleton;
        see :meth:`DiffusersPipelineLoader.load`), e.g. to refuse a request it cannot take."""
        if config.model.model is None:
            raise ValueError("--model is required")
        self.model_dir = config.model.model
        self.config = config
        self._check_pipeline = check_pipeline
        self.device = resolve_device(config.model)
        self.dtype = resolve_dtype(config.model, self.device)
        self.topology = Topology()
        self.backend: DistributedLayerwiseOffloadBackend | None = None
        self.compiled: compilation.CompiledBlocks | None = None
        """What ``--compile`` did (``None`` without it)."""
        self.device_plan: DevicePlan | None = None
        """Where ``--max-gpu-memory-gib`` placed each component (``None`` without it)."""
        self.streaming_advisor: device_budget.StreamingAdvisor | None = None
        """Rank 0's, where the plan streams and keeps a text encoder resident that it could
        stream: see :meth:`after_request`."""
        self._pipeline: DiffusionPipeline | None = None
        self._backing: BackingDecision | None = None
        self._previous_sigterm: signal._HANDLER = None

    def __enter__(self) -> Worker:
        self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self.start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.shutdown()

    def start(self) -> None:
        # Before any weight is read: a diffusers offload mode needs a CUDA device and, for
        # group offloading, a DiT class diffusers supports.
        policy = self.config.effective().offload_policy
        diffusers_offload.check_device(policy, self.device)
        compilation.check_device(self.config.effective().compile, self.device)
        diffusers_offload.check_model(policy, self.model_dir, DIT_COMPONENTS)
        lora.check_files(self.config.model.lora_adapters)
        sequence_parallel.check_model(self.model_dir, DIT_COMPONENTS, self.config.parallel)
        if self.config.offload.dlo_staging == Staging.RING:
            staging_ring.check_built()
        device_budget.check_text_encoders(self.config)
        budget_gib = self.config.offload.max_gpu_memory_gib
        if device_budget.plans_placement(self.config):
            self.device_plan = device_budget.plan_device(self.config, self.dtype)
            self.config = device_budget.planned_config(self.config, self.device_plan)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if budget_gib is not None:
            device_budget.cap_device_memory(self.device, budget_gib)
        self.topology = init_topology(self.config.parallel, self.device)
        loader = DiffusersPipelineLoader(
            load_settings(self.config),
            dtype=self.dtype,
            device=self.device,
            edit=weight_edit(self.config),
        )
        self._pipeline = loader.load(self._check_before_loading)
        self._backing = loader.decision
        host_weights = loader.take_host_weights()
        policy = self.config.effective().offload_policy
        if policy in diffusers_offload.DIFFUSERS_POLICIES:
            diffusers_offload.apply(self.pipeline, policy, self.device, DIT_COMPONENTS)
        if policy == OffloadPolicy.DLO:
            self._enable_dlo(host_weights)
            plan = self.device_plan
            if plan is not None and self.topology.rank == 0 and device_budget.may_advise(plan):
                self.streaming_advisor = device_budget.StreamingAdvisor(plan)
        if self.config.model.quantization == Quantization.FP8:
            # A DiT bound to a runtime-cache entry has its scales only now.
            quantization.read_scales(self.pipeline, self.config.offload.dlo_block_paths)
        if self.config.parallel.sequence_parallel_size > 1:
            sequence_parallel.apply(
                self.pipeline, self.config.parallel, self.device, DIT_COMPONENTS
            )
        # After DLO: adapters then live on the device beside the streamed weights.
        lora.load_adapters(
            self.pipeline,
            self.config.model.switchable_lora_adapters,
            self.config.model.max_lora_rank,
        )
        if (mode := self.config.effective().compile) is not None:
            # Adapters chosen per request through scale tensors: switching never recompiles.
            lora.selection(self.pipeline).for_compiled_blocks(self.pipeline, self.device)
            # Last: DLO routes each streamed block's compile() to its forward.
            self.compiled = compilation.compile_blocks(
                self.pipeline,
                mode,
                self.device,
                self.config.offload.dlo_block_paths,
                self.config.model.compile_cache_dir,
            )
            metrics.watch_compilation(self.compiled)

    def _check_before_loading(self, pipeline: DiffusionPipeline) -> None:
        """What the pipeline's meta skeleton shows before any weight is read (the loaded
        pipeline where no skeleton can be built): the adapters fit it, then the caller's
        ``check_pipeline``."""
        model = self.config.model
        lora.check_adapters(
            pipeline, model.fused_lora_adapters, model.switchable_lora_adapters, model.max_lora_rank
        )
        if self._check_pipeline is not None:
            self._check_pipeline(pipeline)

    def after_request(self) -> None:
        """Call after each request: checks the device plan against its copy waits, until it
        advised (reading the stats synchronizes the device, idle by then)."""
        advisor = self.streaming_advisor
        if advisor is not None and advisor.advice is None and self.backend is not None:
            advisor.after_request(self.backend.stats())

    @property
    def pipeline(self) -> DiffusionPipeline:
        """The loaded pipeline (offload enabled); only once :meth:`start` loaded it."""
        if self._pipeline is None:
            raise RuntimeError("the worker has not loaded its model: start it first")
        return self._pipeline

    @property
    def backing(self) -> BackingDecision:
        """How the DiTs' host weights are held and why; only once :meth:`start` loaded them."""
        if self._backing is None:
            raise RuntimeError("the worker has not loaded its model: start it first")
        return self._backing

    def _enable_dlo(self, host_weights: MappedCheckpoint | RuntimeCacheEntry | None) -> None:
        adapter_bytes = 0
        if self.config.offload.dlo_gpu_memory_budget_gib is not None:
            # Loaded after DLO, so the budget is told what they will take.
            adapter_bytes = lora.device_bytes(
                self.config.model.switchable_lora_adapters, self.dtype
            )
        offload_config = offload_config_for(self.config, self.topology.groups, adapter_bytes)
        try:
            self.backend = DistributedLayerwiseOffloadBackend(
                offload_config, self.device, host_weights
            )
            self.backend.enable(self.pipeline)
            stats = self.backend.stats()
            if stats.host_registration != "none":
                metrics.HOST_REGISTRATIONS.labels(result=stats.host_registration).inc()
            if stats.staging != "none":
                metrics.STAGING_STARTS.labels(
                    staging=stats.staging, reason=stats.staging_reason
                ).inc()
            metrics.watch_staging_ring(_ring_activity(self.backend))
        except Exception as error:
            if host_weights is None:
                raise
            # The DiT was never materialized: there is nothing to fall back to.
            host_weights.close()
            raise HostWeightsError(
                f"DLO could not consume the checkpoint mapping ({error}); the DiT was "
                "not loaded ordinarily, so the worker cannot start"
            ) from error

    def shutdown(self) -> None:
        """Disable DLO, then destroy the process groups. Idempotent."""
        if self.backend is not None:
            self.backend.disable()
            self.backend = None
        self.topology.destroy()
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


def weight_edit(config: WorkerConfig) -> HostWeightEdit | None:
    """What the loader writes into the loaded DiTs before their host backing is chosen (so
    before DLO packs them, and into a runtime-cache entry built from them): ``--fuse-lora``
    adapters, or ``--quantization fp8`` (the configuration refuses both together)."""
    if config.model.quantization == Quantization.FP8:
        return quantization.fp8_weights(config.offload.dlo_block_paths)
    return lora.fusion(config.model.fused_lora_adapters)


def _ring_activity(
    backend: DistributedLayerwiseOffloadBackend,
) -> Callable[[], dict[str, float]]:
    """What the staging ring's threads did so far, by activity (empty without a ring)."""

    def read() -> dict[str, float]:
        ring = backend.ring_counters()
        if ring is None:
            return {}
        return {
            "pack": ring.pack_seconds,
            "idle": ring.idle_seconds,
            "ring_full": ring.ring_full_wait_seconds,
            "copy_wait": ring.copy_wait_seconds,
            "feeder_wait": ring.feeder_wait_seconds,
            "feeder_enqueue": ring.feeder_enqueue_seconds,
            "compute_wait": backend.pack_wait_seconds,
            # NaN (no value) where the kernel keeps no scheduler statistics, never 0.
            "runqueue_wait": ring.runqueue_wait_seconds
            if ring.runqueue_wait_seconds is not None
            else math.nan,
        }

    return read


@dataclass(frozen=True)
class BackendOption:
    """A worker option the backend takes: its :class:`OffloadConfig` field, and the unit
    conversion between them (GiB options become byte counts)."""

    option: str
    """The field of :class:`~dlo_worker.config.OffloadOptions` (``--dlo-*``)."""
    field: str
    """The field of :class:`OffloadConfig`."""
    convert: Callable[[Any], Any] = lambda value: value


def _gib_to_bytes(value: float | None) -> int | None:
    return None if value is None else int(value * 2**30)


def _mib_to_bytes(value: int | None) -> int | None:
    return None if value is None else value * 2**20


BACKEND_OPTIONS: tuple[BackendOption, ...] = (
    BackendOption("dlo_use_allgather", "use_allgather"),
    BackendOption("dlo_resident_layers", "resident_layers"),
    BackendOption("dlo_allgather_shard_buffers", "allgather_shard_buffers"),
    BackendOption("dlo_gpu_memory_budget_gib", "gpu_memory_budget_bytes", _gib_to_bytes),
    BackendOption("dlo_block_paths", "block_paths"),
    BackendOption("dlo_stream_text_encoders", "text_encoders"),
    BackendOption("dlo_runtime_cache_pin_limit_gib", "pin_limit_bytes", _gib_to_bytes),
    BackendOption("dlo_staging", "staging", str),
    BackendOption("dlo_staging_chunk_mib", "staging_ring_chunk_bytes", _mib_to_bytes),
    BackendOption("dlo_pack_threads", "pack_threads"),
)
"""The one mapping from worker options to the backend's (the operator's ``CRD_FIELDS``
maps the CRD to the worker options the same way); a test checks both sides exist."""


def offload_config_for(
    config: WorkerConfig,
    groups: dict[ShardingGroup, dist.ProcessGroup],
    adapter_bytes: int = 0,
) -> OffloadConfig:
    """The backend's configuration: :data:`BACKEND_OPTIONS`, the existing DP (else SP)
    group the worker configuration selects for DLO's weight sharding, and the device bytes
    of the LoRA adapters loaded after it (counted in the GPU memory budget)."""
    effective = config.effective()
    group = groups.get(effective.dlo_sharding_group)
    options = {
        option.field: option.convert(value)
        for option in BACKEND_OPTIONS
        # Unset: the backend's own default (for some, chosen from the machine).
        if (value := getattr(config.offload, option.option)) is not None
    }
    return OffloadConfig(
        process_group=group if effective.dlo_sharding_size > 1 else None,
        adapter_bytes=adapter_bytes,
        **options,
    )
