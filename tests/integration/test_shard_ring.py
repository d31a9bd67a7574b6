"""AllGather's shard ring over gloo: shards are copied ahead of their gather, and the
output stays bitwise equal to resident for any ring depth."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dlo_worker.offload import OffloadConfig, enable_dlo
from tests.support.equivalence import check_shard_ring_rank
from tests.support.ranks import spawn_ranks
from tests.support.tiny_models import plain_stack

CPU = torch.device("cpu")
BLOCKS = 7


def _staged_ahead_rank(rank: int, world_size: int, store_path: str, depth: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    torch.set_num_threads(1)
    try:
        check_shard_ring_rank(CPU, depth, BLOCKS)

        case = plain_stack(blocks=BLOCKS)
        backend = enable_dlo(
            case.model,
            device=CPU,
            process_group=dist.group.WORLD,
            allgather_shard_buffers=depth,
        )
        staged_at: dict[int, set[int]] = {}
        assert backend._enabled is not None
        ring = backend._enabled.slots.shard_ring  # the ring is what this test is about
        names = {id(block): index for index, block in enumerate(case.model.layers)}
        for index, block in enumerate(case.model.layers):
            # Registered after DLO's pre-hook, so it sees the state that hook left.
            block.register_forward_pre_hook(
                lambda _m, _a, index=index: staged_at.__setitem__(
                    index, {names[id(b.block.module)] for b in ring if b.block is not None}
                )
            )
        with torch.inference_mode():
            case.forward()  # learns the order
            case.forward()
        for index in range(BLOCKS):
            in_slots = {index, (index + 1) % BLOCKS}
            expected = {(index + step) % BLOCKS for step in range(2, 2 + depth)} - in_slots
            assert staged_at[index] == expected, (index, staged_at[index], expected)
        backend.disable()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("depth", [2, 3, 6])
def test_shards_are_copied_ahead_of_their_gather_and_stay_bitwise(
    depth: int, tmp_path: Path
) -> None:
    spawn_ranks(_staged_ahead_rank, (2, str(tmp_path / "store"), depth), 2)


def test_a_ring_of_fewer_than_two_shard_buffers_is_refused() -> None:
    with pytest.raises(ValueError, match="allgather_shard_buffers must be >= 2"):
        OffloadConfig(allgather_shard_buffers=1)
