"""Each slot carries its state and every step checks where it starts: a load never lands on
weights compute still reads, a slot that holds nothing never runs, a release follows a use.
On the CPU (synchronous copies) a loaded slot is ready at once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dlo_worker.offload.block import StreamedBlock
from dlo_worker.offload.feeds.arena import ARENA
from dlo_worker.offload.layout import layout_of, slot_capacity
from dlo_worker.offload.slots import SlotPair, SlotState, SlotStateError, TransferCounters

CPU = torch.device("cpu")


def arena_block(name: str, value: float) -> StreamedBlock:
    weight = torch.full((4, 3), value)
    block = StreamedBlock(
        name=name, module=nn.Identity(), layout=layout_of([("w", weight)]), parameters=[]
    )
    block.arena_views[torch.float32] = weight.reshape(-1)
    block.feed = ARENA
    return block


@pytest.fixture
def blocks() -> tuple[StreamedBlock, StreamedBlock]:
    return arena_block("blocks.0", 1.0), arena_block("blocks.1", 2.0)


def slot_pair(blocks: tuple[StreamedBlock, ...]) -> SlotPair:
    capacity = slot_capacity([block.layout for block in blocks], 1)
    return SlotPair(CPU, capacity, process_group=None, shards=1, counters=TransferCounters())


def test_a_slot_goes_released_ready_in_use_released(blocks) -> None:
    slots = slot_pair(blocks)
    first, _ = blocks
    assert [slot.state for slot in slots.slots] == [SlotState.RELEASED] * 2
    slots.load(first, 0)
    assert slots.slots[0].state == SlotState.READY
    assert torch.equal(slots.slots[0].buffers[torch.float32][:12], torch.ones(12))
    slots.wait_ready(0)
    assert slots.slots[0].state == SlotState.IN_USE
    slots.release(0)
    assert slots.slots[0].state == SlotState.RELEASED
    # Released but still holding its block: it runs again without a load.
    assert slots.index_of(first) == 0
    slots.wait_ready(0)
    assert slots.counters.blocks_loaded == 1


def test_loading_over_a_slot_in_use_is_refused_and_keeps_its_weights(blocks) -> None:
    slots = slot_pair(blocks)
    first, second = blocks
    slots.load(first, 0)
    slots.wait_ready(0)
    with pytest.raises(SlotStateError, match=r"slot 0 is in use \(holding blocks.0\)"):
        slots.load(second, 0)
    assert slots.slots[0].block is first
    assert torch.equal(slots.slots[0].buffers[torch.float32][:12], torch.ones(12))


def test_running_an_empty_slot_or_releasing_an_idle_one_is_refused(blocks) -> None:
    slots = slot_pair(blocks)
    with pytest.raises(SlotStateError, match="slot 1 holds no block"):
        slots.wait_ready(1)
    slots.load(blocks[0], 1)
    with pytest.raises(SlotStateError, match=r"slot 1 is ready .* cannot become released"):
        slots.release(1)
    slots.wait_ready(1)
    with pytest.raises(SlotStateError, match="slot 1 is in use"):
        slots.wait_ready(1)


def test_a_block_without_a_host_feed_is_refused_before_any_copy(blocks) -> None:
    slots = slot_pair(blocks)
    unbound = arena_block("blocks.2", 3.0)
    unbound.feed = None
    with pytest.raises(SlotStateError, match=r"blocks\.2 has no feed"):
        slots.load(unbound, 0)
