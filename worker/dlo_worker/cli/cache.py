"""``dlo-worker cache warm``: build (or join) the entry a worker configuration would use,
without process groups, a device or serving: what a per-node warm Job runs."""

from __future__ import annotations

import time

import torch

from dlo_worker.config import WorkerConfig, load_settings
from dlo_worker.process.devices import resolve_device, resolve_dtype


def warm_runtime_cache(config: WorkerConfig) -> dict:
    """Load the pipeline on the CPU with the dtype the configured device would use and
    report what the runtime cache did (``result``: built, joined, fallback, not-needed)."""
    from dlo_worker.loader.diffusers_loader import DiffusersPipelineLoader
    from dlo_worker.pipeline import lora
    from dlo_worker.process.worker import weight_edit

    started = time.perf_counter()
    # The entry's identity includes the dtype: resolve it for the device that will serve
    # (auto is bfloat16 on CUDA) even where this process has no GPU.
    target = (
        resolve_device(config.model)
        if config.model.device == "auto"
        else torch.device(config.model.device)
    )
    dtype = resolve_dtype(config.model, target)
    lora.check_files(config.model.fused_lora_adapters)
    loader = DiffusersPipelineLoader(
        load_settings(config),
        dtype=dtype,
        device=torch.device("cpu"),
        # The entry holds the weights the worker will stream: --fuse-lora adapters fused,
        # or FP8.
        edit=weight_edit(config),
    )
    loader.load()
    host_weights = loader.take_host_weights()
    if host_weights is not None:
        host_weights.close()
    report = loader.cache_report
    if report is None:
        return {
            "result": "not-needed",
            "reason": loader.decision.reason if loader.decision else "",
            "seconds": round(time.perf_counter() - started, 3),
        }
    return {
        "result": report.result,
        "key": report.key,
        "bytes": report.bytes,
        "seconds": round(time.perf_counter() - started, 3),
        "cache_seconds": round(report.seconds, 3),
        "reason": report.reason,
    }
