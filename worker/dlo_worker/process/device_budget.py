"""``--max-gpu-memory-gib`` at start: plan the pipeline against it, turn the plan into the
options that carry it out, and cap the device's allocator at it.

The plan (:mod:`dlo_worker.loader.device_plan`) is made from the checkpoint headers
before any weight is read and carried out by options that exist on their own: DLO on or
off, the DiT's share (``--dlo-gpu-memory-budget-gib``, which keeps as many blocks resident
as fit) and the text encoders DLO streams (``--dlo-stream-text-encoders``). On a CUDA
device larger than the budget the caching allocator is limited to it
(``torch.cuda.set_per_process_memory_fraction``), so going over is an out-of-memory error
rather than a silent use of memory a smaller GPU would not have.

After each request :class:`StreamingAdvisor` checks the plan against what the request
measured: a text encoder the plan kept resident that would be cheaper streamed is said
once (the plan is made before anything runs and cannot know the step's copy waits).
"""

from __future__ import annotations

import logging

import torch

from dlo_worker.config import OffloadPolicy, Quantization, WorkerConfig
from dlo_worker.loader.component_bytes import component_bytes
from dlo_worker.loader.device_plan import (
    GIB,
    DeviceBudgetError,
    DevicePlan,
    StreamingAdvice,
    plan_device_memory,
    streaming_advice,
)
from dlo_worker.loader.diffusers_loader import DIT_COMPONENTS
from dlo_worker.loader.model_directory import (
    ModelDirectoryError,
    listed_components,
    read_json_object,
)
from dlo_worker.observability import metrics
from dlo_worker.offload.plan import TEXT_ENCODER_BLOCK_LISTS
from dlo_worker.offload.stats import OffloadStats

logger = logging.getLogger(__name__)

TEXT_ENCODER_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def plans_placement(config: WorkerConfig) -> bool:
    """Whether ``--max-gpu-memory-gib`` places the components (pure): it does unless one of
    diffusers' offload modes was chosen, which places them itself; the budget then only
    caps the allocator, so the modes are measured at the same budget."""
    return config.offload.max_gpu_memory_gib is not None and config.effective().offload_policy in (
        OffloadPolicy.NONE,
        OffloadPolicy.DLO,
    )


def plan_device(config: WorkerConfig, dtype: torch.dtype) -> DevicePlan:
    """Plan ``config``'s model against its ``--max-gpu-memory-gib`` (set)."""
    budget_gib = config.offload.max_gpu_memory_gib
    if budget_gib is None or config.model.model is None:
        raise ValueError("plan_device needs --model and --max-gpu-memory-gib")
    fp8 = DIT_COMPONENTS if config.model.quantization == Quantization.FP8 else ()
    sizes = component_bytes(config.model.model, dtype, dits=DIT_COMPONENTS, fp8_components=fp8)
    plan = plan_device_memory(
        sizes,
        round(budget_gib * GIB),
        dits=DIT_COMPONENTS,
        text_encoders=TEXT_ENCODER_COMPONENTS,
        stream_dits=config.offload.enable_distributed_layerwise_offload,
        streamed_text_encoders=config.offload.dlo_stream_text_encoders,
    )
    logger.info("device memory plan", extra={"fields": plan.log_fields()})
    return plan


def check_text_encoders(config: WorkerConfig) -> None:
    """Refuse, before any weight is read, a ``--dlo-stream-text-encoders`` name that is not
    a text encoder of the model DLO can stream."""
    if config.model.model is None or not config.offload.dlo_stream_text_encoders:
        return
    index_path = config.model.model / "model_index.json"
    components = listed_components(read_json_object(index_path))
    for name in config.offload.dlo_stream_text_encoders:
        if name not in components or name not in TEXT_ENCODER_COMPONENTS:
            encoders = [c for c in components if c in TEXT_ENCODER_COMPONENTS]
            raise ModelDirectoryError(
                f"--dlo-stream-text-encoders names {name!r}, which is not a text encoder "
                f"of {index_path} (it has {', '.join(encoders) or 'none'}); name one of them"
            )
        class_name = components[name][1]
        if class_name not in TEXT_ENCODER_BLOCK_LISTS:
            raise ModelDirectoryError(
                f"--dlo-stream-text-encoders names {name!r}, a {class_name}, whose blocks DLO "
                f"does not know how to stream (it streams "
                f"{', '.join(sorted(TEXT_ENCODER_BLOCK_LISTS))}); drop it from the list"
            )


def planned_config(config: WorkerConfig, plan: DevicePlan) -> WorkerConfig:
    """``config`` with the options that carry ``plan`` out, validated again (pure). A plan
    that streams turns DLO on, streaming complete blocks on each rank (the budget is per
    GPU). The budget itself is then carried by the DiT's
    share, so the returned configuration no longer names it."""
    if plan.streamed_weights_budget is None:
        return config
    values = config.model_dump()
    values["offload"].update(
        enable_distributed_layerwise_offload=True,
        dlo_gpu_memory_budget_gib=plan.streamed_weights_budget / GIB,
        dlo_stream_text_encoders=plan.streamed(TEXT_ENCODER_COMPONENTS),
        max_gpu_memory_gib=None,
        # Rank-local whatever was asked: the rules refuse a budget with DLO AllGather over
        # more than one rank, and a DiT share with AllGather named at all.
        dlo_use_allgather=False,
    )
    return type(config).model_validate(values)


def cap_device_memory(device: torch.device, budget_gib: float) -> None:
    """Limit the caching allocator of a CUDA ``device`` to ``budget_gib`` (refused when
    the device is smaller); the CPU has no device memory to cap."""
    if device.type != "cuda":
        logger.info(
            "device memory budget not enforced",
            extra={"fields": {"device": str(device), "reason": "not a CUDA device"}},
        )
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    budget = budget_gib * GIB
    if budget > total:
        raise DeviceBudgetError(
            f"--max-gpu-memory-gib {budget_gib} is more than {device}'s "
            f"{total / GIB:.2f} GiB; lower it, or leave it unset to use the whole GPU"
        )
    torch.cuda.set_per_process_memory_fraction(budget / total, index)


def device_peak(device: torch.device) -> dict[str, float]:
    """The CUDA allocator's peaks so far (GiB): what a budget must hold."""
    return {
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / GIB, 4),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / GIB, 4),
    }


def may_advise(plan: DevicePlan) -> bool:
    """Whether :class:`StreamingAdvisor` could ever advise under ``plan`` (pure): it streams
    and keeps a text encoder resident that DLO could stream."""
    return plan.streams and bool(plan.resident_streamable(TEXT_ENCODER_COMPONENTS))


class StreamingAdvisor:
    """Says once, after a request, when a text encoder the plan keeps resident is worth
    streaming (:func:`~dlo_worker.loader.device_plan.streaming_advice`): a log line naming
    the option, and ``dlo_streaming_advised{component}`` set to 1.

    A request counts only when every block it ran was prefetched: the first one, while DLO
    learns the blocks' order, waits for copies a steady request does not.
    """

    def __init__(self, plan: DevicePlan) -> None:
        self._plan = plan
        self._seen: OffloadStats | None = None
        self.advice: StreamingAdvice | None = None
        """What was advised, once it was."""

    def after_request(self, stats: OffloadStats) -> None:
        before, self._seen = self._seen, stats
        if self.advice is not None or before is None:
            return
        if stats.on_demand_loads != before.on_demand_loads:
            return
        advice = streaming_advice(
            self._plan,
            TEXT_ENCODER_COMPONENTS,
            stats.exposed_wait_seconds - before.exposed_wait_seconds,
            stats.h2d_gbps * 1e9,
        )
        if advice is None:
            return
        self.advice = advice
        metrics.STREAMING_ADVISED.labels(component=advice.component).set(1)
        logger.info(
            "placement advice: stream this text encoder too",
            extra={"fields": advice.log_fields()},
        )
