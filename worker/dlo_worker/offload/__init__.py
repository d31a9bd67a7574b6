"""Distributed Layerwise Offload: stream DiT blocks from host memory through two device slots.

Library users call :func:`enable_dlo`; the worker builds a
:class:`DistributedLayerwiseOffloadBackend` from its configuration. Hooks are
private to the backend, and ``disable()`` is the only way out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dlo_worker.offload.backend import BackendState, DistributedLayerwiseOffloadBackend
from dlo_worker.offload.config import OffloadConfig
from dlo_worker.offload.errors import OffloadSetupError, UnsupportedHostBackingError
from dlo_worker.offload.plan import DiscoveryError, OffloadPlan, discover
from dlo_worker.offload.stats import OffloadStats


def enable_dlo(
    model_or_pipeline: object,
    *,
    device: torch.device | str,
    use_allgather: bool = True,
    process_group: dist.ProcessGroup | None = None,
    resident_layers: int = 0,
    gpu_memory_budget_gib: float | None = None,
    block_paths: Sequence[str] | None = None,
    allgather_shard_buffers: int = OffloadConfig.allgather_shard_buffers,
    text_encoders: Sequence[str] = (),
) -> DistributedLayerwiseOffloadBackend:
    """Stream the DiT blocks of a diffusers pipeline or a module; returns the enabled backend.

    ``process_group`` is the existing group to shard host weights over (AllGather);
    ``None`` or a group of size one streams complete blocks rank-locally.
    ``resident_layers`` blocks of each DiT stay on the device, spread evenly through it;
    or ``gpu_memory_budget_gib`` keeps as many as fit beside the DiT's non-block weights and
    the two slots, chosen so the streamed bytes spread evenly through the forward.
    ``block_paths`` names the DiT's block lists (e.g. ``["transformer_blocks"]``) where
    discovery cannot find them. ``allgather_shard_buffers`` (AllGather) is how many
    blocks' shards may sit on the device between their copy and their gather.
    ``text_encoders`` (e.g. ``["text_encoder_2"]``, a T5) stream through the same slots.
    """
    config = OffloadConfig(
        use_allgather=use_allgather,
        process_group=process_group,
        resident_layers=resident_layers,
        gpu_memory_budget_bytes=None
        if gpu_memory_budget_gib is None
        else int(gpu_memory_budget_gib * 2**30),
        block_paths=tuple(block_paths) if block_paths else None,
        allgather_shard_buffers=allgather_shard_buffers,
        text_encoders=tuple(text_encoders),
    )
    return DistributedLayerwiseOffloadBackend(config, device).enable(model_or_pipeline)


__all__ = [
    "BackendState",
    "DiscoveryError",
    "DistributedLayerwiseOffloadBackend",
    "OffloadConfig",
    "OffloadPlan",
    "OffloadSetupError",
    "OffloadStats",
    "UnsupportedHostBackingError",
    "discover",
    "enable_dlo",
]
