"""The engine's process groups, built from the torch launcher's environment.

Ranks are laid out with TP innermost, then SP, then DP (``rank = dp * SP * TP +
sp * TP + tp``), so a TP group is a run of neighbouring ranks (one node) and DP
replicas are farthest apart. DLO never creates its own topology: it borrows the
DP or SP group built here (see :func:`dlo_worker.config.dlo_sharding_group`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dlo_worker.config import ParallelOptions, ShardingGroup
from dlo_worker.errors import UserFixableError

logger = logging.getLogger(__name__)


class TopologyError(RuntimeError, UserFixableError):
    """The launcher's world does not match the configured parallel sizes."""


@dataclass(frozen=True)
class RankCoordinates:
    data_parallel_rank: int
    sequence_parallel_rank: int
    tensor_parallel_rank: int


def rank_coordinates(rank: int, parallel: ParallelOptions) -> RankCoordinates:
    """Where ``rank`` sits in the DP x SP x TP grid (pure)."""
    tp, sp = parallel.tensor_parallel_size, parallel.sequence_parallel_size
    return RankCoordinates(rank // (sp * tp), (rank // tp) % sp, rank % tp)


def group_ranks(parallel: ParallelOptions) -> dict[ShardingGroup, list[list[int]]]:
    """Every DP group and every SP group as rank lists (pure; all ranks build all groups)."""
    dp, sp, tp = (
        parallel.data_parallel_size,
        parallel.sequence_parallel_size,
        parallel.tensor_parallel_size,
    )
    data_parallel = [
        [d * sp * tp + s * tp + t for d in range(dp)] for s in range(sp) for t in range(tp)
    ]
    sequence_parallel = [
        [d * sp * tp + s * tp + t for s in range(sp)] for d in range(dp) for t in range(tp)
    ]
    return {
        ShardingGroup.DATA_PARALLEL: data_parallel,
        ShardingGroup.SEQUENCE_PARALLEL: sequence_parallel,
    }


@dataclass
class Topology:
    """This process's place in the engine and the groups it belongs to."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    coordinates: RankCoordinates = RankCoordinates(0, 0, 0)
    groups: dict[ShardingGroup, dist.ProcessGroup] = field(default_factory=dict)
    initialized_here: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def destroy(self) -> None:
        """Tear down the process groups this topology created. Idempotent."""
        if self.initialized_here and dist.is_initialized():
            dist.destroy_process_group()
            logger.info("process groups destroyed", extra={"fields": {"rank": self.rank}})
        self.groups.clear()
        self.initialized_here = False


def launcher_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_topology(parallel: ParallelOptions, device: torch.device) -> Topology:
    """Join the launcher's world (gloo on the CPU, NCCL on CUDA) and build DP and SP groups."""
    world_size = launcher_world_size()
    if world_size != parallel.world_size:
        raise TopologyError(
            f"the launcher started {world_size} process(es) but --data-parallel-size x "
            f"--sequence-parallel-size x --tensor-parallel-size = {parallel.world_size}; "
            f"run under torchrun --nproc-per-node {parallel.world_size} or fix the sizes"
        )
    if world_size == 1:
        return Topology()
    rank = int(os.environ["RANK"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    groups: dict[ShardingGroup, dist.ProcessGroup] = {}
    for kind, rank_lists in group_ranks(parallel).items():
        for ranks in rank_lists:
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks and isinstance(group, dist.ProcessGroup):
                groups[kind] = group
    topology = Topology(
        rank=rank,
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        coordinates=rank_coordinates(rank, parallel),
        groups=groups,
        initialized_here=True,
    )
    logger.info(
        "process groups ready",
        extra={"fields": {"rank": rank, "world_size": world_size, "backend": backend}},
    )
    return topology
