"""Run a tiny model resident and under DLO, and compare bitwise; shared by CPU and GPU tests."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dlo_worker.offload import OffloadStats, enable_dlo
from dlo_worker.offload.layout import BlockLayout, slot_capacity
from tests.support.tiny_models import BUILDERS

FORWARDS = 3


@dataclass
class EquivalenceResult:
    resident: list[torch.Tensor]
    offloaded: list[torch.Tensor]
    stats: OffloadStats
    block_bytes: list[int]
    layouts: list[BlockLayout]

    @property
    def bitwise_equal(self) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.resident, self.offloaded, strict=True))


def run_equivalence(
    name: str,
    device: torch.device,
    *,
    seed: int = 0,
    use_allgather: bool = False,
    process_group: dist.ProcessGroup | None = None,
    resident_layers: int = 0,
    allgather_shard_buffers: int = 4,
    forwards: int = FORWARDS,
    **builder_options: int,
) -> EquivalenceResult:
    """Resident outputs first (on ``device``), then DLO on a second copy of the same weights."""
    case = BUILDERS[name](seed, **builder_options)
    resident_model = copy.deepcopy(case.model).to(device)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in case.inputs.items()}
    with torch.inference_mode():
        resident = [_output(resident_model(**inputs)).cpu() for _ in range(forwards)]
    del resident_model
    backend = enable_dlo(
        case.model,
        device=device,
        use_allgather=use_allgather,
        process_group=process_group,
        resident_layers=resident_layers,
        allgather_shard_buffers=allgather_shard_buffers,
    )
    try:
        with torch.inference_mode():
            offloaded = [_output(case.model(**inputs)).cpu() for _ in range(forwards)]
        stats = backend.stats()
        layouts = backend.block_layouts()
        block_bytes = [layout.nbytes for layout in layouts]
    finally:
        backend.disable()
    return EquivalenceResult(resident, offloaded, stats, block_bytes, layouts)


RANK_LOCAL_CASES: dict[str, tuple[str, dict[str, int]]] = {
    "flux": ("flux", {}),
    "dit-odd": ("dit", {"blocks": 3}),
    "dit-even": ("dit", {"blocks": 4}),
    "wan": ("wan", {"blocks": 3}),
    "plain-odd": ("plain", {"blocks": 5}),
    "plain-even": ("plain", {"blocks": 6}),
    "plain-single": ("plain", {"blocks": 1}),
}
"""Models with odd, even and single block counts, for the rank-local equivalence tests."""

ALLGATHER_CASES: tuple[tuple[str, dict[str, int]], ...] = (
    ("flux", {}),
    ("dit", {"blocks": 3}),
    ("wan", {"blocks": 2}),
    ("plain", {"blocks": 5}),
)


def check_allgather_rank(device: torch.device) -> list[tuple[str, dict, EquivalenceResult]]:
    """On one rank of the default group: every tiny model under DLO AllGather matches resident
    bitwise (also with a shallow and a deep shard ring), and this rank keeps about 1/N of the
    block bytes on the host."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for name, options in ALLGATHER_CASES:
        result = run_equivalence(
            name, device, use_allgather=True, process_group=dist.group.WORLD, **options
        )
        assert result.bitwise_equal, f"{name}: rank {rank} differs from resident"
        assert result.stats.transfer_mode == "allgather"
        assert result.stats.shards == world_size
        assert result.stats.allgather_bytes > 0
        assert result.stats.host_bytes < sum(result.block_bytes) / world_size * 1.05 + 4096
        results.append((name, options, result))
    for depth in (2, 6):
        check_shard_ring_rank(device, depth)
    return results


def check_shard_ring_rank(device: torch.device, depth: int, blocks: int = 7) -> None:
    """On one rank of the default group: AllGather with ``depth`` shard buffers matches
    resident bitwise, loads nothing on demand and holds two slots plus ``depth`` shards."""
    world_size = dist.get_world_size()
    result = run_equivalence(
        "plain",
        device,
        use_allgather=True,
        process_group=dist.group.WORLD,
        allgather_shard_buffers=depth,
        blocks=blocks,
    )
    assert result.bitwise_equal, f"{depth} shard buffers: rank {dist.get_rank()} differs"
    assert result.stats.on_demand_loads == 0
    # Each slot holds the largest block padded to a multiple of the group; a shard is 1/N.
    padded = slot_capacity(result.layouts, world_size)
    shard_bytes = sum(numel // world_size * dtype.itemsize for dtype, numel in padded.items())
    assert result.stats.device_slot_bytes == (2 * world_size + depth) * shard_bytes


def _output(output: object) -> torch.Tensor:
    return output.sample if hasattr(output, "sample") else output
