"""OffloadConfig: how the backend streams, with live process groups.

It knows nothing of pipelines or of the worker's configuration (as diffusers'
``GroupOffloadingConfig``); the worker builds one from its configuration and topology
(:func:`dlo_worker.process.worker.offload_config`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

MAX_PACK_THREADS = 8


def default_pack_threads() -> int:
    """This process's share of the CPUs it may run on (ranks of a node split them), up to 8.

    Packing is memory-bound: beyond a few threads per process it only competes with
    the other ranks and with the device copies for memory bandwidth.
    """
    cpus = len(os.sched_getaffinity(0))
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(MAX_PACK_THREADS, cpus // max(ranks_here, 1)))


@dataclass(frozen=True)
class OffloadConfig:
    """How the backend streams: transfer protocol, group, resident layers, block lists."""

    use_allgather: bool = True
    process_group: dist.ProcessGroup | None = None
    """The DLO weight-sharding group; ``None`` (or size one) streams rank-locally."""
    resident_layers: int = 0
    gpu_memory_budget_bytes: int | None = None
    """Device bytes for the DiT weights (non-block weights, LoRA adapters, slots, resident
    blocks); the backend keeps as many blocks resident as fit. Excludes
    ``resident_layers``."""
    adapter_bytes: int = 0
    """Device bytes of LoRA adapters that will be loaded after enable (the worker's
    ``--lora``), counted in the budget like the adapters the blocks already hold."""
    block_paths: Sequence[str] | None = None
    """Attribute paths of the DiT's block lists, overriding discovery."""
    allgather_shard_buffers: int = 4
    """Device buffers for this rank's shards (AllGather; each the largest block / group
    size): shards are copied up to this many blocks before their gather, so blocks whose
    copies outlast their compute borrow time from blocks whose compute outlasts theirs."""
    staging_buffers: int = 3
    """Page-locked staging buffers for checkpoint-backed blocks that are not registered
    (each the largest such block): packs run up to this many blocks ahead of the copies,
    so a pack that runs slow for one block does not leave the copy engine idle."""
    staging_ring: bool = False
    """Stage unregistered mapped blocks through the native cache-sized chunk ring
    (:mod:`dlo_worker.offload.feeds.ring`; an error where it was not built) instead of
    block-sized staging buffers. Off by default until measured on a GPU host."""
    staging_ring_chunk_bytes: int = 8 * 2**20
    """Bytes per chunk of the staging ring (two chunks per pack thread): small enough
    that the ring stays in the CPU's last-level cache, large enough that a copy's fixed
    cost is under 1% of it."""
    pack_threads: int = field(default_factory=default_pack_threads)
    """Host threads that pack checkpoint-backed blocks into staging (and AllGather shards)."""
    pin_limit_bytes: int = 0
    """Host bytes this process may pin (register with the driver) so rank-local mapped
    blocks on CUDA are copied directly from their mapping (0: always stage)."""
    host_registration_timeout_s: float = 600.0
    """Registration taking longer falls back to staging (checked between ranges)."""

    def __post_init__(self) -> None:
        if self.resident_layers < 0:
            raise ValueError(f"resident_layers must be >= 0, got {self.resident_layers}")
        if self.allgather_shard_buffers < 2:
            raise ValueError(
                f"allgather_shard_buffers must be >= 2, got {self.allgather_shard_buffers}"
            )
        if self.adapter_bytes < 0:
            raise ValueError(f"adapter_bytes must be >= 0, got {self.adapter_bytes}")
        if self.pin_limit_bytes < 0:
            raise ValueError(f"pin_limit_bytes must be >= 0, got {self.pin_limit_bytes}")
        if self.staging_buffers < 2:
            raise ValueError(f"staging_buffers must be >= 2, got {self.staging_buffers}")
        if self.staging_ring_chunk_bytes < 4096 or self.staging_ring_chunk_bytes % 4096:
            raise ValueError(
                "staging_ring_chunk_bytes must be a positive multiple of 4096, got "
                f"{self.staging_ring_chunk_bytes}"
            )
        if self.pack_threads < 1:
            raise ValueError(f"pack_threads must be >= 1, got {self.pack_threads}")
        resident = self.resident_layers or self.gpu_memory_budget_bytes is not None
        if resident and self.use_allgather and self._group_size() > 1:
            raise ValueError(
                "resident blocks (resident_layers, gpu_memory_budget_bytes) require "
                "use_allgather=False (--dlo-no-use-allgather)"
            )
        if self.resident_layers and self.gpu_memory_budget_bytes is not None:
            raise ValueError("set resident_layers or gpu_memory_budget_bytes, not both")

    def _group_size(self) -> int:
        return dist.get_world_size(self.process_group) if self.process_group is not None else 1
