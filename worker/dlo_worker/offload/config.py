"""OffloadConfig: the backend's slice of the worker configuration, with live process groups.

``from_worker_config`` is where the torch-free :class:`~dlo_worker.config.WorkerConfig`
meets the running topology: it picks the existing DP (else SP) group the
configuration selects for DLO's weight sharding.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from dlo_worker.config import ShardingGroup, WorkerConfig

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
    """Device bytes for the DiT weights (non-block weights, slots, resident blocks); the
    backend keeps as many blocks resident as fit. Excludes ``resident_layers``."""
    block_paths: Sequence[str] | None = None
    """Attribute paths of the DiT's block lists, overriding discovery."""
    pack_threads: int = field(default_factory=default_pack_threads)
    """Host threads that pack checkpoint-backed blocks into staging (and AllGather shards)."""

    def __post_init__(self) -> None:
        if self.resident_layers < 0:
            raise ValueError(f"resident_layers must be >= 0, got {self.resident_layers}")
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

    @classmethod
    def from_worker_config(
        cls, config: WorkerConfig, groups: dict[ShardingGroup, dist.ProcessGroup]
    ) -> OffloadConfig:
        """Select the group the configuration names from the worker's existing groups."""
        effective = config.effective()
        group = groups.get(effective.dlo_sharding_group)
        return cls(
            use_allgather=config.offload.dlo_use_allgather,
            process_group=group if effective.dlo_sharding_size > 1 else None,
            resident_layers=config.offload.dlo_resident_layers,
            gpu_memory_budget_bytes=None
            if config.offload.dlo_gpu_memory_budget_gib is None
            else int(config.offload.dlo_gpu_memory_budget_gib * 2**30),
            block_paths=config.offload.dlo_block_paths,
        )
