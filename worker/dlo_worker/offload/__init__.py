"""Distributed Layerwise Offload: stream DiT blocks from host memory through two device slots.

Library users call :func:`enable_dlo`; the worker builds a
:class:`DistributedLayerwiseOffloadBackend` from its configuration. Hooks are
private to the backend, and ``disable()`` is the only way out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dlo_worker.offload.backend import (
    DistributedLayerwiseOffloadBackend,
    OffloadSetupError,
    OffloadStats,
    UnsupportedHostBackingError,
)
from dlo_worker.offload.config import OffloadConfig
from dlo_worker.offload.plan import DiscoveryError, OffloadPlan, discover


def enable_dlo(
    model_or_pipeline: object,
    *,
    device: torch.device | str,
    use_allgather: bool = True,
    process_group: dist.ProcessGroup | None = None,
    resident_layers: int = 0,
) -> DistributedLayerwiseOffloadBackend:
    """Stream the DiT blocks of a diffusers pipeline or a module; returns the enabled backend.

    ``process_group`` is the existing group to shard host weights over (AllGather);
    ``None`` or a group of size one streams complete blocks rank-locally.
    """
    config = OffloadConfig(
        use_allgather=use_allgather, process_group=process_group, resident_layers=resident_layers
    )
    return DistributedLayerwiseOffloadBackend(config, device).enable(model_or_pipeline)


__all__ = [
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
